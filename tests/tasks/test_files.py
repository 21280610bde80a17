"""JSONL and saved-dataset loading: good rows, every bad-row kind with file:line, skip mode."""

import json

import pytest

from covey.tasks import DataError, Example, load_examples, load_hf_dataset, load_jsonl


def write(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    return path


def test_good_rows_answers_as_strings_and_meta(tmp_path):
    path = write(tmp_path, [json.dumps({"prompt": "2+2?", "answer": 4, "level": "easy"}),
                            "",  # blank lines are ignored, not errors
                            json.dumps({"prompt": "1/2?", "answer": "0.5"}),
                            json.dumps({"prompt": "pi?", "answer": 3.14})])
    examples, skipped = load_jsonl(path)
    assert skipped == 0
    assert examples == [Example("2+2?", "4", {"answer": 4, "level": "easy"}), Example("1/2?", "0.5", {"answer": "0.5"}),
                        Example("pi?", "3.14", {"answer": 3.14})]  # meta: every column but the prompt, as given


def test_custom_column_names(tmp_path):
    path = write(tmp_path, [json.dumps({"question": "q", "solution": "7", "answer": "other"})])
    (ex,), _ = load_jsonl(path, prompt_key="question", answer_key="solution")
    assert ex == Example("q", "7", {"answer": "other", "solution": "7"})  # every column under its own name


GOOD = json.dumps({"prompt": "p", "answer": "1"})


@pytest.mark.parametrize("bad,message", [
    ('{"prompt": "p"}', "missing field 'answer' (other rows have it)"),
    ('{"answer": "1"}', "missing field 'prompt'"),
    ('{"prompt": "p", "answer": 1', "invalid JSON: Expecting ',' delimiter at column 28"),
    ("not json", "invalid JSON: Expecting value at column 1"),
    ('["p", "1"]', "expected a JSON object, got list"),
    ('{"prompt": "p", "answer": "  "}', "field 'answer' is empty"),
    ('{"prompt": 3, "answer": "1"}', "field 'prompt' must be a string or a list of chat messages, got int"),
    ('{"prompt": "", "answer": "1"}', "field 'prompt' is empty"),
    (b'{"prompt": "\xff", "answer": "1"}', "not valid UTF-8"),
])
def test_bad_row_names_file_and_line(tmp_path, bad, message):
    path = write(tmp_path, [GOOD, GOOD, bad, GOOD])
    with pytest.raises(DataError) as info:
        load_jsonl(path)
    text = str(info.value)
    assert text.startswith(f"{path}:3: ") and message in text
    assert "\n" not in text
    examples, skipped = load_jsonl(path, on_error="skip")
    assert len(examples) == 3 and skipped == 1


def test_empty_and_all_bad_files(tmp_path):
    empty = write(tmp_path, [""], name="empty.jsonl")
    with pytest.raises(DataError, match=r"empty\.jsonl: empty dataset \(no rows\)"):
        load_jsonl(empty)
    bad = write(tmp_path, ["{}", "[]"], name="bad.jsonl")
    with pytest.raises(DataError, match=r"bad\.jsonl: empty dataset \(all 2 rows were invalid and skipped\)"):
        load_jsonl(bad, on_error="skip")


def test_missing_file_and_bad_option(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: file not found"):
        load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="on_error"):
        load_jsonl(write(tmp_path, [GOOD]), on_error="ignore")


def test_load_examples_dispatches_on_file(tmp_path):
    path = write(tmp_path, [GOOD])
    assert load_examples(path, split=None) == ([Example("p", "1", {"answer": "1"})], 0)


# ------------------------------------------------------------ Hugging Face datasets

def test_hf_dataset_and_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {"prompt": ["a", "b", "c"], "answer": [1, None, 3], "extra": [1, 2, 3]}
    ds = datasets.Dataset.from_dict(rows)
    ds.save_to_disk(str(tmp_path / "ds"))
    examples, skipped = load_hf_dataset(tmp_path / "ds")  # a null answer is the row's (no reference to verify)
    assert examples == [Example("a", "1", {"answer": 1, "extra": 1}), Example("b", None, {"answer": None, "extra": 2}),
                        Example("c", "3", {"answer": 3, "extra": 3})] and skipped == 0

    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    assert load_examples(tmp_path / "dd", split="test") == ([Example("a", "1", {"answer": 1, "extra": 1})], 0)
    with pytest.raises(DataError, match="the dataset has splits train, test: choose one with task.split"):
        load_hf_dataset(tmp_path / "dd")
    with pytest.raises(DataError, match=r"no split 'tset' \(task.split / task.eval_split\); available: train, test"):
        load_hf_dataset(tmp_path / "dd", split="tset")
    (ex,), _ = load_hf_dataset(tmp_path / "dd", split="test", answer_key="solution")  # no such column: prompt-only
    assert ex.answer is None and ex.meta == {"answer": 1, "extra": 1}
    with pytest.raises(DataError, match=r"dd\[test\]: missing column 'question' \(columns: prompt, answer, extra; "
                                        r"set task.prompt_key=prompt\)"):
        load_hf_dataset(tmp_path / "dd", split="test", prompt_key="question")


def test_hf_dataset_bad_paths(tmp_path):
    pytest.importorskip("datasets")
    with pytest.raises(DataError, match="dataset folder not found"):
        load_hf_dataset(tmp_path / "missing")
    (tmp_path / "notads").mkdir()
    with pytest.raises(DataError, match="not a dataset saved with save_to_disk"):
        load_hf_dataset(tmp_path / "notads")


def test_hf_without_datasets_installed_says_how_to_fix(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    (tmp_path / "ds").mkdir()
    with pytest.raises(ImportError, match=r"pip install 'covey\[datasets\]'"):
        load_hf_dataset(tmp_path / "ds")


# ------------------------------------------------------------ CSV, JSON, Parquet; held-out data


def test_csv_json_and_parquet_read_like_jsonl(tmp_path):
    rows = [{"question": "Capital of France?", "solution": "Paris", "level": "1"},
            {"question": "Capital of Peru?", "solution": "Lima", "level": "2"}]
    expected = [Example("Capital of France?", "Paris", {"level": "1", "solution": "Paris"}),
                Example("Capital of Peru?", "Lima", {"level": "2", "solution": "Lima"})]
    (tmp_path / "d.csv").write_text("question,solution,level\nCapital of France?,Paris,1\n"
                                    "\"Capital of Peru?\",Lima,2\n")
    (tmp_path / "d.json").write_text(json.dumps(rows))
    paths = [tmp_path / "d.csv", tmp_path / "d.json"]
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow
    pq.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "d.parquet")
    paths.append(tmp_path / "d.parquet")
    for path in paths:
        examples, skipped = load_examples(path, prompt_key="question", answer_key="solution")
        assert (examples, skipped) == (expected, 0), path


def test_bad_csv_and_json_name_the_file_and_row(tmp_path):
    bad_csv = tmp_path / "d.csv"
    bad_csv.write_text("prompt,answer\nq1,1\nq2,2,extra\nq3\n")
    with pytest.raises(DataError, match=r"d.csv:3: the row's field count differs from the header's \(2 fields\)"):
        load_examples(bad_csv)
    examples, skipped = load_examples(bad_csv, on_error="skip")
    assert [ex.prompt for ex in examples] == ["q1"] and skipped == 2
    not_list = tmp_path / "d.json"
    not_list.write_text('{"prompt": "q", "answer": "1"}')
    with pytest.raises(DataError, match=r"d.json: expected a JSON list of objects \(one per row\), got dict"):
        load_examples(not_list)
    bad_row = tmp_path / "e.json"
    bad_row.write_text('[{"prompt": "q", "answer": "1"}, {"prompt": "q"}]')
    with pytest.raises(DataError, match=r"e.json row 1: missing field 'answer'"):
        load_examples(bad_row)


def test_held_out_split_and_overlap(tmp_path):
    datasets = pytest.importorskip("datasets")
    from covey.config import load_config
    from covey.tasks.data import load_task_data
    train = datasets.Dataset.from_dict({"prompt": ["a", "b", "c", "d"], "answer": ["1", "2", "3", "4"]})
    test = datasets.Dataset.from_dict({"prompt": ["c", "e"], "answer": ["3", "5"]})  # "c" is in both
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dd"))
    cfg = load_config(None, ["task.name=file", f"task.path={tmp_path / 'dd'}", "task.split=train",
                             "task.eval_split=test"])
    data = load_task_data(cfg.task, 0)
    assert [ex.prompt for ex in data.train] == ["a", "b", "c", "d"]
    assert [ex.prompt for ex in data.eval] == ["c", "e"] and data.overlap == 1
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in "abcd"))
    cfg = load_config(None, ["task.name=file", f"task.path={jsonl}", "task.eval_split=test"])
    with pytest.raises(ValueError, match="task.eval_split=test needs a saved HF dataset folder"):
        load_task_data(cfg.task, 0)
    cfg = load_config(None, ["task.name=file", f"task.path={jsonl}", f"task.eval_path={jsonl}"])
    assert load_task_data(cfg.task, 0).overlap == 4  # evaluating on the training rows: all counted


# ------------------------------------------------------------ what a TRL user's data looks like


def test_prompt_only_rows_string_and_chat_have_no_reference(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    path = write(tmp_path, [json.dumps({"prompt": "Write a haiku."}), json.dumps({"prompt": chat, "id": 7})])
    (plain, conversational), skipped = load_jsonl(path)
    assert skipped == 0 and plain == Example("Write a haiku.", None)
    assert conversational.answer is None and conversational.meta == {"id": 7}
    assert conversational.given_prompt == chat


def test_list_and_null_answers_travel_as_they_are(tmp_path):
    path = write(tmp_path, [json.dumps({"prompt": "a", "answer": ["Paris", "paris"]}),
                            json.dumps({"prompt": "b", "answer": None}),
                            json.dumps({"prompt": "c", "answer": {"x": 1}}), json.dumps({"prompt": "d", "answer": 5})])
    examples, _ = load_jsonl(path)
    assert [ex.answer for ex in examples] == [None, None, None, "5"]  # what a verifier can read
    assert [ex.meta["answer"] for ex in examples] == [["Paris", "paris"], None, {"x": 1}, 5]  # what functions get


def test_rows_without_the_answer_before_one_with_it_are_named(tmp_path):
    path = write(tmp_path, [json.dumps({"prompt": "a"}), json.dumps({"prompt": "b"}), GOOD])
    with pytest.raises(DataError) as info:
        load_jsonl(path)
    assert str(info.value) == f"{path}:1: missing field 'answer' (other rows have it, such as {path}:3)"
    examples, skipped = load_jsonl(path, on_error="skip")
    assert [ex.prompt for ex in examples] == ["p"] and skipped == 2


def test_a_missing_prompt_field_names_a_likely_column(tmp_path):
    path = write(tmp_path, [json.dumps({"question": "q", "answer": "1"})])
    with pytest.raises(DataError) as info:
        load_jsonl(path)
    assert str(info.value) == (f"{path}:1: missing field 'prompt' (the row has: question, answer; "
                               "set task.prompt_key=question)")


def test_excel_csv_utf8_with_a_byte_order_mark_reads_like_any_other(tmp_path):
    path = tmp_path / "excel.csv"
    with open(path, "w", encoding="utf-8-sig", newline="") as fh:  # Excel's "CSV UTF-8": BOM and \r\n
        fh.write("prompt,answer\r\nCapital of France?,Paris\r\n\"Two, three?\",5\r\n")
    examples, skipped = load_examples(path)
    assert skipped == 0
    assert examples == [Example("Capital of France?", "Paris", {"answer": "Paris"}),
                        Example("Two, three?", "5", {"answer": "5"})]
    bom_json = tmp_path / "d.jsonl"
    bom_json.write_text(json.dumps({"prompt": "q", "answer": "1"}) + "\n", encoding="utf-8-sig")
    assert load_examples(bom_json)[0] == [Example("q", "1", {"answer": "1"})]


# ------------------------------------------------------------ the held-out split and what the data decides


def rows_file(tmp_path, n, answer=True, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"prompt": f"q{i}", **({"answer": str(i)} if answer else
                                                              {"solution": str(i)})}) + "\n" for i in range(n)))
    return path


def test_eval_size_zero_trains_on_every_row_and_says_so(tmp_path):
    from covey.config import load_config
    from covey.tasks.data import load_task_data
    path = rows_file(tmp_path, 10)
    data = load_task_data(load_config(None, ["task.name=file", f"task.path={path}", "task.eval_size=0"]).task, 0)
    assert len(data.train) == 10 and data.eval == []
    assert data.notes == ["no held-out evaluation (task.eval_size=0): every example trains, and no accuracy is "
                          "measured before or after training"]
    one = rows_file(tmp_path, 1, name="one.jsonl")  # one row: nothing to hold out, but eval_size=0 needs none
    assert len(load_task_data(load_config(None, ["task.name=file", f"task.path={one}", "task.eval_size=0"]).task,
                              0).train) == 1


@pytest.mark.parametrize("rows, eval_size, warned", [(30, 200, True), (100, 20, False), (100, 21, True)])
def test_a_held_out_split_that_takes_much_of_the_data_is_announced(tmp_path, rows, eval_size, warned):
    from covey.config import load_config
    from covey.tasks.data import load_task_data
    path = rows_file(tmp_path, rows)
    data = load_task_data(load_config(None, ["task.name=file", f"task.path={path}",
                                             f"task.eval_size={eval_size}"]).task, 0)
    n_eval = min(eval_size, rows // 2)
    assert len(data.eval) == n_eval and len(data.train) == rows - n_eval
    expected = [f"warning: task.eval_size={eval_size} holds out {n_eval} of the {rows} rows of {path} "
                f"({n_eval / rows:.0%}), leaving {rows - n_eval} to train on: set task.eval_size (0 trains on "
                "every row, with no held-out evaluation) or task.eval_path"]
    assert data.notes == (expected if warned else [])


def test_prompt_only_data_is_judged_by_the_reward_and_names_the_answer_column(tmp_path):
    from covey.config import load_config
    from covey.tasks.data import load_run_data
    path = rows_file(tmp_path, 10, answer=False)  # {"prompt", "solution"}: the answers under another name
    cfg = load_config(None, ["task.name=file", f"task.path={path}", "task.eval_size=2"])
    settled, data = load_run_data(cfg, extra_rewards=True)  # reward functions given in Python
    assert (settled.eval.metric, settled.reward.correctness) == ("reward", 0.0)
    assert (cfg.eval.metric, cfg.reward.correctness) == ("auto", 1.0)  # the caller's config is left as it was
    assert data.notes[-1] == (f"{path}: there is no 'answer' column, so the correctness reward is off and held-out "
                              "answers are judged by the reward functions (eval.metric=reward, passing at "
                              "eval.reward_threshold=1); set task.answer_key=solution if that column holds the "
                              "answers")
    strict = load_config(None, ["task.name=file", f"task.path={path}", "eval.metric=exact"])
    with pytest.raises(ValueError) as info:
        load_run_data(strict)
    assert str(info.value) == (f"eval.metric=exact compares answers with the reference, but in {path} there is no "
                               "'answer' column: set eval.metric=reward to judge held-out answers by your reward "
                               "functions; set task.answer_key=solution if that column holds the answers")
    named, _ = load_run_data(load_config(None, ["task.name=file", f"task.path={path}", "task.answer_key=solution"]))
    assert (named.eval.metric, named.reward.correctness) == ("math", 1.0)


def test_some_rows_without_a_readable_answer_need_the_correctness_reward_off(tmp_path):
    from covey.config import load_config
    from covey.tasks.data import load_run_data
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": [str(i)] if i < 3 else str(i)}) + "\n"
                            for i in range(10)))
    keys = ["task.name=file", f"task.path={path}", "task.eval_size=0"]
    with pytest.raises(ValueError) as info:
        load_run_data(load_config(None, keys))
    # rows 1 to 3 hold lists: the first is named by its line, whatever order the rows were shuffled into
    assert str(info.value) == (f"{path}: 3 of 10 rows have no reference answer a verifier reads (null, a list, ...), "
                               f"the first at {path}:1, which the correctness reward needs in every row: set "
                               "reward.correctness=0 to train on your reward functions alone")
    settled, _ = load_run_data(load_config(None, [*keys, "reward.correctness=0", "reward.format=1"]))
    assert settled.eval.metric == "reward"


def test_the_recorded_config_holds_absolute_data_paths_and_the_resolved_metric(tmp_path, monkeypatch):
    from covey.config import load_config
    from covey.tasks.data import load_run_data
    rows_file(tmp_path, 10)
    (tmp_path / "rewards.py").write_text("def f(completions, **_):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    settled, _ = load_run_data(load_config(None, ["task.name=file", "task.path=d.jsonl", "task.eval_path=d.jsonl",
                                                  "reward.functions=rewards.py:f:0.5, tests.helpers:varied_reward"]))
    assert settled.task.path == settled.task.eval_path == str(tmp_path / "d.jsonl")
    assert settled.reward.functions == f"{tmp_path / 'rewards.py'}:f:0.5,tests.helpers:varied_reward"
    assert settled.eval.metric == "math"  # auto, resolved from the numeric answers
    assert load_run_data(load_config(None, []))[0].eval.metric == "math"  # the built-in tasks too


def test_an_unterminated_string_names_its_column_once(tmp_path):
    # json says "Unterminated string starting at"; the column follows it without a second "at"
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1}\n')
    with pytest.raises(DataError) as err:
        load_jsonl(path)
    assert str(err.value) == f"{path}:1: invalid JSON: Unterminated string starting at column 27"
