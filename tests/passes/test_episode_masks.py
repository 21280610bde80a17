"""Multi-turn episodes through the train-time passes: the environment's tokens between the model's turns are
attended (`Rollout.response_attention`) and counted in the positions; the model's tokens (`response_mask`) get
exactly the log-probs, entropy and values of the same whole sequence run as a plain single-turn response."""

import dataclasses

import pytest
import torch

from covey import algos
from covey.batch import Rollout, concat_rollouts
from covey.config import Config
from covey.models.critic import ValueModel
from covey.models.load import load_policy
from covey.passes import logprobs, packing
from covey.training import update
from covey.training.global_batch import global_normalizer
from covey.training.plan import make_plan

M, E = 1, 0  # a model token, an environment token
# Four rows, two prompts (two rows each, so the packed pass shares a prompt between rows). Row 0: a model
# turn of 3, a tool result of 4, a model turn of 2. Row 1: 1 model token, 2 environment tokens, 3 model
# tokens. Row 2 ends on environment tokens (an episode cut after a tool call): its last attended token
# (column 9) is the widest of the batch, so the passes' width is 10 of the 12 columns, and the last model
# token of the batch is at column 8. Row 3 is a single-turn response (attention = mask).
LAYOUTS = [[M, M, M, E, E, E, E, M, M],
           [M, E, E, M, M, M],
           [M, M, E, E, E, M, M, E, E, E],
           [M, M, M, M, M]]
WIDTH = 12


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model, tokenizer = load_policy(tiny_model_dir)
    return model.eval(), tokenizer


def episode_rollout(tokenizer, seed: int = 0) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    vocab, pad, n = len(tokenizer), tokenizer.pad_token_id, len(LAYOUTS)
    prompts = [torch.randint(3, vocab, (5,), generator=g), torch.randint(3, vocab, (3,), generator=g)]
    prompt_ids = torch.stack([torch.cat([torch.full((5 - len(p),), pad), p]) for p in prompts])[[0, 0, 1, 1]]
    prompt_mask = (prompt_ids != pad).long()
    prompt_mask[:, -3:] = 1  # every prompt's last 3 tokens are real, whatever ids were drawn
    mask, attention = torch.zeros(n, WIDTH), torch.zeros(n, WIDTH)
    for i, layout in enumerate(LAYOUTS):
        mask[i, :len(layout)] = torch.tensor(layout, dtype=torch.float)
        attention[i, :len(layout)] = 1.0
    response = torch.where(attention.bool(), torch.randint(3, vocab, (n, WIDTH), generator=g), pad)
    groups = torch.tensor([0, 0, 1, 1])
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response, response_mask=mask,
                   group_ids=groups, truncated=torch.zeros(n, dtype=torch.bool), completions=[""] * n,
                   example_index=groups.tolist(), response_attention=attention)


def as_single_turn(episode: Rollout) -> Rollout:
    """The same token sequences as plain single-turn responses: every real token a response token."""
    return dataclasses.replace(episode, response_mask=episode.response_attention.clone(), response_attention=None)


def with_holes(episode: Rollout) -> Rollout:
    """The environment's tokens masked out of attention too: what the passes did before response_attention."""
    return dataclasses.replace(episode, response_attention=None)


def episode_logprobs(model, part, *, packed: bool, monkeypatch, prompts=None):
    """policy_logprobs by the padded pass, or by the packed one (checked to have run)."""
    packings = []
    with monkeypatch.context() as patch, torch.no_grad():
        if not packed:
            patch.setattr(logprobs, "packs", lambda model: False)
        patch.setattr(logprobs, "pack", lambda *a, **k: packings.append(1) or packing.pack(*a, **k))
        out = logprobs.policy_logprobs(model, part, 0.7, with_entropy=True, prompts=prompts)
    assert len(packings) == (packed and logprobs.prefixes(part.response_attended))
    return out


def test_positions_and_width_count_every_attended_token(tiny):
    _, tokenizer = tiny
    episode = episode_rollout(tokenizer)
    ids, mask, width = logprobs.trim(episode)
    assert width == 10  # row 2's last (environment) token, not the batch's last model token (column 8)
    assert mask[:, -width:].sum(1).tolist() == [9, 6, 10, 5]
    # row 0's prompt has 5 real tokens (positions 0..4): its second model turn (columns 7, 8) sits at
    # positions 5 + 7 = 12 and 13, after the 3 model and 4 environment tokens
    from covey.models.hf_compat import position_ids
    assert position_ids(mask)[0, -width:][7:9].tolist() == [12, 13]


@pytest.mark.parametrize("packed", [False, True])
def test_model_tokens_get_the_logprobs_of_the_whole_sequence(tiny, monkeypatch, packed):
    """Against the plain padded pass over the same sequences as single-turn responses: equal (bitwise in the
    plain pass, which sees the same ids and mask; to float rounding in the packed one)."""
    model, tokenizer = tiny
    episode = episode_rollout(tokenizer)
    expected, expected_entropy, width = episode_logprobs(model, as_single_turn(episode), packed=False,
                                                         monkeypatch=monkeypatch)
    logp, entropy, got_width = episode_logprobs(model, episode, packed=packed, monkeypatch=monkeypatch)
    assert got_width == width == 10
    keep = episode.response_mask[:, :width].bool()
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if packed else {"atol": 0.0, "rtol": 0.0}
    torch.testing.assert_close(logp[keep], expected[keep], **tolerance)
    torch.testing.assert_close(entropy[keep], expected_entropy[keep], **tolerance)
    # the test can fail: with the environment's tokens left out of attention (holes in the one mask: the
    # plain pass, as the packed one feeds only masks without holes), the second turns differ
    holes, _, hole_width = episode_logprobs(model, with_holes(episode), packed=packed, monkeypatch=monkeypatch)
    assert hole_width == 9  # the last model token, column 8 of row 0
    second_turn = torch.zeros_like(keep[:, :9])
    second_turn[0, 7:9] = second_turn[1, 3:6] = second_turn[2, 5:7] = True
    assert (holes[second_turn] - expected[:, :9][second_turn]).abs().min() > 1e-4
    first_turns = ~second_turn & keep[:, :9]
    torch.testing.assert_close(holes[first_turns], expected[:, :9][first_turns], atol=1e-6, rtol=1e-6)


def test_prompt_cache_pass_and_batched_logprobs_agree(tiny, monkeypatch):
    """The step's prompts encoded once (covey/passes/prompt_cache.py), micro-batches of 2 rows with their own
    widths (rows 0-1: 9, rows 2-3: 10), and the no-grad batched pass: all equal the single-turn reference
    on the model's tokens, and the batched pass is 0 on the environment's."""
    model, tokenizer = tiny
    episode = episode_rollout(tokenizer)
    expected, _, width = episode_logprobs(model, as_single_turn(episode), packed=False, monkeypatch=monkeypatch)
    keep = episode.response_mask.bool()
    with torch.no_grad():
        encoded, of_row = logprobs.encode_prompts(model, episode, torch.arange(len(episode)))
    for rows in (torch.tensor([0, 1]), torch.tensor([2, 3])):
        logp, _, w = episode_logprobs(model, episode.select(rows), packed=True, monkeypatch=monkeypatch,
                              prompts=(encoded, of_row[rows]))
        part = keep[rows, :w]
        torch.testing.assert_close(logp[part], expected[rows, :w][part], atol=1e-5, rtol=1e-5)
    batched = logprobs.batched_logprobs(model, episode, 0.7, micro_batch_size=2)
    assert batched.shape == (4, WIDTH)
    torch.testing.assert_close(batched[keep], logprobs.pad_to(expected, WIDTH)[keep], atol=1e-5, rtol=1e-5)
    assert batched[~keep].abs().sum() == 0


def test_critic_values_over_an_episode(tiny_model_dir, tiny):
    """The critic reads V before each model token over the whole sequence, environment tokens included."""
    _, tokenizer = tiny
    critic = ValueModel.from_policy_path(tiny_model_dir).eval()
    torch.nn.init.normal_(critic.head.weight, generator=torch.Generator().manual_seed(1))  # not the zero head
    episode = episode_rollout(tokenizer)
    with torch.no_grad():
        expected, width = logprobs.critic_values(critic, as_single_turn(episode))
        values, got_width = logprobs.critic_values(critic, episode)
        holes, _ = logprobs.critic_values(critic, with_holes(episode))
    keep = episode.response_mask[:, :width].bool()
    assert got_width == width == 10
    torch.testing.assert_close(values[keep], expected[keep], atol=0.0, rtol=0.0)
    assert (holes[0, 7:9] - expected[0, 7:9]).abs().min() > 1e-6
    batched = logprobs.batched_values(critic, episode, micro_batch_size=3)
    full_keep = episode.response_mask.bool()
    torch.testing.assert_close(batched[full_keep], logprobs.pad_to(expected, WIDTH)[full_keep], atol=1e-6, rtol=1e-5)
    assert batched[~full_keep].abs().sum() == 0


def test_single_turn_rollout_is_unchanged(tiny, monkeypatch):
    """response_attention=None: the passes see cat(prompt_mask, response_mask), as before it existed, and an
    explicit response_attention equal to response_mask gives bitwise the same log-probs."""
    model, tokenizer = tiny
    single = as_single_turn(episode_rollout(tokenizer))
    ids, mask, width = logprobs.trim(single)
    first = logprobs.first_prompt_column(single.prompt_mask)
    assert torch.equal(mask, torch.cat([single.prompt_mask[:, first:], single.response_mask[:, :width].long()], 1))
    assert torch.equal(single.attention_mask, torch.cat([single.prompt_mask, single.response_mask.long()], 1))
    explicit = dataclasses.replace(single, response_attention=single.response_mask.clone())
    for packed in (False, True):
        a, ent_a, _ = episode_logprobs(model, single, packed=packed, monkeypatch=monkeypatch)
        b, ent_b, _ = episode_logprobs(model, explicit, packed=packed, monkeypatch=monkeypatch)
        assert torch.equal(a, b) and torch.equal(ent_a, ent_b)


def test_select_and_concat_carry_the_attention(tiny):
    _, tokenizer = tiny
    episode = episode_rollout(tokenizer)
    picked = episode.select(torch.tensor([2, 0]))
    assert torch.equal(picked.response_attention, episode.response_attention[[2, 0]])
    narrow = dataclasses.replace(picked, response_ids=picked.response_ids[:, :10],
                                 response_mask=picked.response_mask[:, :10],
                                 response_attention=picked.response_attention[:, :10])
    single = as_single_turn(episode).select(torch.tensor([3]))
    merged = concat_rollouts([narrow, single], tokenizer.pad_token_id)
    # padded with 0 to the widest part (12); the single-turn part brings its response_mask
    assert merged.response_attention.shape == (3, WIDTH)
    assert merged.response_attention.sum(1).tolist() == [10, 9, 5]
    assert torch.equal(merged.response_attention[2], episode.response_mask[3])
    assert concat_rollouts([single, single], tokenizer.pad_token_id).response_attention is None


def test_environment_tokens_carry_no_loss_and_no_gradient(tiny_model_dir):
    """The trainer's micro-batch loss (covey.training.update.micro_policy_loss) over an episode: advantages of
    1000 put on the environment's tokens change neither the loss nor any gradient, and the loss is the
    objective of the single-turn pass's log-probs on the model's tokens under token_mean over those tokens."""
    model, tokenizer = load_policy(tiny_model_dir)
    cfg = Config()
    cfg.algo.loss_agg, cfg.algo.entropy_coef, cfg.rollout.max_new_tokens = "token_mean", 0.01, WIDTH
    opts = make_plan(cfg).update
    episode = episode_rollout(tokenizer)
    env = episode.response_attention - episode.response_mask
    episode.advantages = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(2)) * episode.response_mask
    loud = dataclasses.replace(episode, advantages=episode.advantages + 1000.0 * env)
    norm = global_normalizer(opts.loss_agg, episode.response_mask, WIDTH)
    assert norm.total_tokens == 5 + 4 + 4 + 5  # the model's tokens of rows 0..3; 11 environment tokens left out

    def loss_and_grads(part):
        model.zero_grad(set_to_none=True)
        loss, _ = update.micro_policy_loss(model, part, norm, opts, kl_coef=0.0)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (loss, grads), (loud_loss, loud_grads) = loss_and_grads(episode), loss_and_grads(loud)
    assert torch.equal(loss, loud_loss) and grads.keys() == loud_grads.keys() and grads
    assert all(torch.equal(grads[n], loud_grads[n]) for n in grads)
    with torch.no_grad():
        logp, entropy, width = logprobs.policy_logprobs(model, as_single_turn(episode), opts.temperature,
                                                       with_entropy=True)
        inp = algos.PolicyInputs(logp, logp, episode.advantages[:, :width], episode.response_mask[:, :width],
                                 entropy=entropy)
        expected, _ = algos.policy_objective(inp, norm, algos.ObjectiveOptions(opts.policy_loss, opts.loss,
                                                                               entropy_coef=0.01))
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-5)
