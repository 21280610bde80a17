"""A user's reward function named on the command line: 'module:function' from an installed module or
the current folder (however covey was started), or 'path/to/file.py:function' (which may import the
modules beside it); one line when it cannot be loaded."""

import subprocess
import sys

import pytest

from covey.rewards.build import load_callable

REWARD_FILE = '''
def brevity(completions, **kwargs):
    return [-len(c) / 100 for c in completions]
'''


def test_a_function_from_a_python_file(tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    fn = load_callable(f"{tmp_path / 'my_rewards.py'}:brevity")
    assert fn(completions=["abcd", ""]) == [-0.04, 0.0]


@pytest.mark.parametrize("spec,message", [
    ("./nowhere.py:f", "reward function './nowhere.py:f': cannot import ./nowhere.py: no file nowhere.py"),
    ("no_such_module_xyz:f", "reward function 'no_such_module_xyz:f': cannot import no_such_module_xyz: "
                             "No module named 'no_such_module_xyz'"),
    ("json:no_such_function", "reward function 'json:no_such_function': json has no callable 'no_such_function'"),
    ("json", "reward function 'json' must look like module:function or file.py:function"),
])
def test_what_cannot_be_loaded_is_one_line(spec, message):
    with pytest.raises(ValueError) as err:
        load_callable(spec)
    assert str(err.value) == message


def test_a_broken_file_is_one_line(tmp_path):
    (tmp_path / "broken.py").write_text("def f(:\n")
    with pytest.raises(ValueError, match=r"^reward function '.*broken.py:f': cannot import .*broken.py: "
                                         r"invalid syntax") as err:
        load_callable(f"{tmp_path / 'broken.py'}:f")
    assert "\n" not in str(err.value)


def test_a_module_in_the_current_folder_imports_without_python_dash_m(tmp_path):
    """The `covey` console script (not `python -m`) has no current folder on sys.path."""
    (tmp_path / "folder_rewards.py").write_text(REWARD_FILE)
    code = ("import sys; sys.path = [p for p in sys.path if p not in ('', '.')]\n"
            "from covey.rewards.build import load_callable\n"
            "print(load_callable('folder_rewards:brevity')(completions=['ab']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[-0.02]"


def test_a_reward_file_imports_the_module_beside_it(tmp_path):
    """As a script does: `from helpers import ...` at the top of the file, and inside a function when called."""
    folder = tmp_path / "rewards_here"
    folder.mkdir()
    (folder / "beside_helpers.py").write_text("def length(text):\n    return len(text)\n")
    (folder / "later_helpers.py").write_text("SCALE = 10\n")
    (folder / "my_rewards.py").write_text(
        "from beside_helpers import length\n\n"
        "def scaled(completions, **kwargs):\n"
        "    import later_helpers\n"
        "    return [length(c) * later_helpers.SCALE for c in completions]\n")
    fn = load_callable(f"{folder / 'my_rewards.py'}:scaled")
    assert fn(completions=["abc"]) == [30]
