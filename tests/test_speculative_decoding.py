"""Speculative decoding by n-gram prompt lookup: the same outputs as decoding one token per step,
whatever the drafts; right drafts are all accepted (fewer steps), wrong ones cost nothing else.

A random-weight model rarely repeats itself, so most tests draft from an oracle: the reference
run's own continuation, correct or with chosen tokens corrupted.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from vacpack import LLM, SamplingParams
from vacpack.engine import speculation
from vacpack.engine.draft_verification import NO_DRAFT, verify_drafts
from vacpack.engine.ngram_proposer import propose_ngram_drafts
from vacpack.engine.sampler import Sampler, SamplingRow
from vacpack.engine.speculation import MAX_PAUSE_STEPS, DraftState, accepted_tokens

NUM_DRAFTS = 4


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return str(tiny_checkpoint("qwen2"))


@pytest.fixture(scope="module")
def plain(model_dir) -> LLM:
    return LLM(model_dir, dtype="float32", block_size=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def speculative(model_dir) -> LLM:
    return LLM(
        model_dir,
        dtype="float32",
        block_size=8,
        max_num_batched_tokens=64,
        speculative_config={"method": "ngram", "num_speculative_tokens": NUM_DRAFTS},
    )


def _prompts(num_prompts: int = 5, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (num_prompts,), generator=generator).tolist()
    return [torch.randint(3, 500, (n,), generator=generator).tolist() for n in lengths]


def _outputs(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[tuple]:
    return [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason)
        for o in llm.generate(prompts, params, use_tqdm=False)
        for c in o.outputs
    ]


@pytest.fixture
def oracle(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    """Drafts from `continuations` (prompt tuple -> the reference's output tokens), with the
    draft positions in `wrong` (counted from the first output token) replaced by a wrong token."""
    state: dict = {"continuations": {}, "wrong": set(), "calls": 0, "drafted_for": set()}

    def drafts(token_ids: list[int], min_ngram: int, max_ngram: int, max_drafts: int):
        state["calls"] += 1
        for prompt, continuation in state["continuations"].items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                state["drafted_for"].add(prompt)
                done = len(token_ids) - len(prompt)
                proposed = continuation[done : done + max_drafts]
                return [
                    (token + 1) % 500 if done + i in state["wrong"] else token
                    for i, token in enumerate(proposed)
                ]
        return []

    monkeypatch.setattr(speculation, "propose_ngram_drafts", drafts)
    yield state


def test_right_drafts_are_all_accepted_in_fewer_steps(plain, speculative, oracle) -> None:
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = _outputs(plain, prompts, params)
    oracle["continuations"] = {tuple(p): e[0] for p, e in zip(prompts, expected, strict=True)}
    engine = speculative.engine
    before = engine.state()
    assert _outputs(speculative, prompts, params) == expected
    after = engine.state()
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
    assert drafted > 0 and accepted == drafted
    # Prefill, then about 40 / (1 + NUM_DRAFTS) decode steps instead of 40.
    assert after.num_steps - before.num_steps <= 40 // (1 + NUM_DRAFTS) + 4
    pool = engine.page_pool
    pool.check_consistency()
    assert pool.num_free_pages == pool.num_pages


def test_wrong_drafts_change_nothing_but_the_acceptance(plain, speculative, oracle) -> None:
    prompts = _prompts(seed=1)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = _outputs(plain, prompts, params)
    oracle["continuations"] = {tuple(p): e[0] for p, e in zip(prompts, expected, strict=True)}
    oracle["wrong"] = {0, 2, 3, 9, 10, 11, 12, 20, 29}
    before = speculative.engine.state()
    assert _outputs(speculative, prompts, params) == expected
    after = speculative.engine.state()
    accepted = after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
    assert 0 < accepted < after.num_draft_tokens - before.num_draft_tokens


@pytest.mark.parametrize(
    "stop",
    [
        {"max_tokens": 13},  # ends inside a run of accepted drafts
        {"stop_token_ids": "output 6"},
        {"stop": "output 4..6"},
        {"min_tokens": 7, "stop_token_ids": "output 3"},  # held back until min_tokens
    ],
)
def test_stops_inside_accepted_drafts_end_where_they_would(
    plain, speculative, oracle, stop: dict
) -> None:
    prompts = _prompts(3, seed=2)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    free = _outputs(plain, prompts, greedy)
    tokenizer = plain.get_tokenizer()
    reference = free[0][0]
    fields: dict = {"temperature": 0, "max_tokens": 30, "ignore_eos": True}
    for name, value in stop.items():
        if value == "output 6":
            value = [reference[6]]
        elif value == "output 3":
            value = [reference[3]]
        elif value == "output 4..6":
            value = [tokenizer.decode(reference[4:7])]
        fields[name] = value
    params = SamplingParams(**fields)
    expected = _outputs(plain, prompts, params)
    oracle["continuations"] = {tuple(p): e[0] for p, e in zip(prompts, free, strict=True)}
    assert _outputs(speculative, prompts, params) == expected


def test_sampled_and_other_sequences_run_beside_speculating_ones(
    plain, speculative, oracle
) -> None:
    """Seeded samples and penalties do not speculate; their outputs are as without
    speculation, in a batch where greedy sequences do, one of them returning logprobs (each
    accepted token's from its verify row)."""
    prompts = _prompts(4, seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    others = [
        SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, logprobs=2, max_tokens=24, ignore_eos=True),
    ]
    expected = plain.generate(prompts, [greedy, *others], use_tqdm=False)
    oracle["continuations"] = {
        tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, expected, strict=True)
    }
    calls_before = oracle["calls"]
    got = speculative.generate(prompts, [greedy, *others], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    got_logprobs, expected_logprobs = got[3].outputs[0], expected[3].outputs[0]
    assert len(got_logprobs.logprobs) == len(expected_logprobs.logprobs) == 24
    for position, reference in zip(got_logprobs.logprobs, expected_logprobs.logprobs, strict=True):
        assert sorted(position) == sorted(reference)
        for token_id, logprob in position.items():
            assert logprob.logprob == pytest.approx(reference[token_id].logprob, abs=1e-4)
            assert logprob.rank == reference[token_id].rank
    assert got_logprobs.cumulative_logprob == pytest.approx(
        expected_logprobs.cumulative_logprob, abs=1e-3
    )
    assert oracle["calls"] > calls_before
    # The greedy ones drafted, the one with logprobs too; the seeded and penalised did not.
    assert oracle["drafted_for"] == {tuple(prompts[0]), tuple(prompts[3])}


def test_a_tight_cache_with_preemption_and_prefix_sharing(model_dir, plain, oracle) -> None:
    shared = _prompts(1, seed=4)[0] * 2
    prompts = [shared + p for p in _prompts(4, seed=5)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = _outputs(plain, prompts, params)
    oracle["continuations"] = {tuple(p): e[0] for p, e in zip(prompts, expected, strict=True)}
    bytes_per_page = plain.engine.kv_cache.num_bytes // plain.engine.page_pool.num_pages
    longest = max(len(p) for p in prompts) + 40
    tight = LLM(
        model_dir,
        dtype="float32",
        block_size=8,
        max_num_batched_tokens=64,
        max_model_len=longest + 8,
        kv_cache_memory_bytes=bytes_per_page * (-(-(longest + 8) // 8) + 4),
        num_speculative_tokens=NUM_DRAFTS,
    )
    assert _outputs(tight, prompts, params) == expected
    assert tight.engine.stats.num_preemptions > 0
    pool = tight.engine.page_pool
    pool.check_consistency()
    assert pool.num_free_pages == pool.num_pages


def test_the_real_lookup_on_a_repeating_prompt(model_dir, plain) -> None:
    """Without the oracle: a prompt that repeats what the model wrote after its first part gets
    n-gram drafts from it; the outputs are unchanged whatever the model makes of them."""
    first = _prompts(2, seed=6)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    written = [o[0] for o in _outputs(plain, first, params)]
    prompts = [p + w + p for p, w in zip(first, written, strict=True)]
    lookup = LLM(
        model_dir,
        dtype="float32",
        block_size=8,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": NUM_DRAFTS,
            "prompt_lookup_min": 1,
        },
    )
    assert _outputs(lookup, prompts, params) == _outputs(plain, prompts, params)
    assert lookup.engine.state().num_draft_tokens > 0


def test_the_ngram_lookup() -> None:
    assert propose_ngram_drafts([1, 2, 3, 4, 1, 2, 3], 2, 4, 3) == [4, 1, 2]
    assert propose_ngram_drafts([1, 2, 3, 4, 5], 1, 4, 3) == []
    # The latest occurrence with a whole draft after it; the longest n-gram first.
    assert propose_ngram_drafts([9, 1, 2, 5, 5, 8, 1, 2, 6, 6, 1, 2], 2, 2, 2) == [6, 6]
    assert propose_ngram_drafts([3, 1, 2, 7, 7, 9, 1, 2, 8, 8, 3, 1, 2], 1, 3, 2) == [7, 7]
    # A short loop: the earliest occurrence, with the most tokens after it.
    assert propose_ngram_drafts([7, 7, 7, 7, 7, 7], 1, 4, 3) == [7, 7]
    assert propose_ngram_drafts([1, 2, 1, 2], 2, 2, 0) == []


def test_acceptance_stops_at_the_first_wrong_draft() -> None:
    assert accepted_tokens((4, 5, 6), [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert accepted_tokens((4, 5, 6), [4, 9, 6, 7]) == [4, 9]
    assert accepted_tokens((4, 5, 6), [8, 5, 6, 7]) == [8]


def test_speculation_settings_are_checked(model_dir) -> None:
    with pytest.raises(ValueError, match="method 'eagle' is not supported"):
        LLM(model_dir, speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="needs num_speculative_tokens"):
        LLM(model_dir, speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        LLM(model_dir, num_speculative_tokens=2, prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="synchronous"):
        LLM(model_dir, num_speculative_tokens=2, async_scheduling=True)


def test_metrics_count_drafts_and_accepted_tokens(speculative, oracle) -> None:
    from server_process import metric_value

    from vacpack.server.metrics import ServerMetrics

    metrics = ServerMetrics("tiny")
    metrics.set_engine_state(speculative.engine.state())
    prompts = _prompts(2, seed=7)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    oracle["continuations"] = {
        tuple(p): o[0] for p, o in zip(prompts, _outputs(speculative, prompts, params), strict=True)
    }
    before = speculative.engine.state()
    _outputs(speculative, prompts, params)
    after = speculative.engine.state()
    metrics.set_engine_state(after)
    text = metrics.render().decode()
    drafted = metric_value(text, "vacpack:spec_decode_num_draft_tokens_total")
    accepted = metric_value(text, "vacpack:spec_decode_num_accepted_tokens_total")
    # Counted from the engine's start, as every engine total on /metrics.
    assert drafted == after.num_draft_tokens > before.num_draft_tokens
    assert accepted == after.num_accepted_draft_tokens > before.num_accepted_draft_tokens


def test_a_sequence_drafts_by_its_record() -> None:
    """One draft more than its last step accepted; after a step accepting none, a pause of 1,
    2, 4, ... decode steps (up to MAX_PAUSE_STEPS), ended by a step that accepts a draft."""
    state = DraftState()
    assert state.allows_drafts() and state.max_drafts is None
    state.record(2)
    assert state.allows_drafts() and state.max_drafts == 3
    pauses = []
    for _ in range(6):
        state.record(0)
        paused = 0
        while not state.allows_drafts():
            paused += 1
        pauses.append(paused)
    assert pauses == [1, 2, 4, 8, MAX_PAUSE_STEPS, MAX_PAUSE_STEPS]
    assert state.max_drafts == 1
    state.record(1)
    state.record(0)
    assert not state.allows_drafts() and state.allows_drafts()  # back to a pause of one


def test_a_sliding_window_model_speculates_to_the_same_tokens(tiny_checkpoint, oracle) -> None:
    """Drafts past the window's edge: the verify rows attend only within each one's window."""
    model_dir = str(tiny_checkpoint("mistral", sliding_window=12))
    engine_args = {"dtype": "float32", "block_size": 4, "max_num_batched_tokens": 32}
    prompts = _prompts(3, seed=8)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = _outputs(LLM(model_dir, **engine_args), prompts, params)
    oracle["continuations"] = {tuple(p): e[0] for p, e in zip(prompts, expected, strict=True)}
    oracle["wrong"] = {5, 17}
    speculative = LLM(model_dir, num_speculative_tokens=NUM_DRAFTS, **engine_args)
    assert _outputs(speculative, prompts, params) == expected
    assert speculative.engine.state().num_accepted_draft_tokens > 0
    pool = speculative.engine.page_pool
    pool.check_consistency()
    assert pool.num_free_pages == pool.num_pages


def test_rejection_sampling_keeps_each_rows_distribution() -> None:
    """A sampled row yields its draft with the draft's probability, else a token drawn without
    it: every row's tokens follow its distribution (top-k 4 of 6 here) whatever its draft,
    one the model likes, one it never picks, or none; greedy rows yield their argmax."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    sampled = SamplingParams(temperature=1.0, top_k=4)
    expected = torch.softmax(torch.where(logits >= 0.5, logits, float("-inf")), dim=0)
    groups = {"liked draft": 1, "impossible draft": 5, "no draft": NO_DRAFT}
    rows_per_group = 20_000
    sampler = Sampler(6, torch.device("cpu"), seed=0)
    row = SamplingRow(sampled, (), (), None, frozenset())
    greedy_row = SamplingRow(SamplingParams(temperature=0.0), (), (), None, frozenset())
    drafts = [draft for draft in groups.values() for _ in range(rows_per_group)] + [3, NO_DRAFT]
    rows = [row] * (len(drafts) - 2) + [greedy_row] * 2
    tokens = verify_drafts(sampler, logits.repeat(len(drafts), 1), rows, drafts)
    assert tokens[-2:].tolist() == [0, 0]
    for index, name in enumerate(groups):
        group = tokens[index * rows_per_group : (index + 1) * rows_per_group]
        frequencies = torch.bincount(group, minlength=6).float() / rows_per_group
        # Four standard deviations of a share near 0.5 in 20,000 draws: 0.014.
        assert (frequencies - expected).abs().max() < 0.014, (name, frequencies, expected)


def test_unseeded_sampled_sequences_speculate_and_seeded_ones_do_not(speculative, oracle) -> None:
    prompts = _prompts(2, seed=9)
    # Nearly greedy: the greedy continuation drafts are mostly accepted.
    cold = SamplingParams(temperature=0.05, max_tokens=24, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    oracle["continuations"] = {
        tuple(p): o[0] for p, o in zip(prompts, _outputs(speculative, prompts, greedy), strict=True)
    }
    before = speculative.engine.state()
    outputs = speculative.generate(prompts, [cold, cold.clone(seed=5)], use_tqdm=False)
    after = speculative.engine.state()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [24, 24]
    assert after.num_accepted_draft_tokens > before.num_accepted_draft_tokens
    # Only the unseeded one drafted: at most its 23 decode steps' worth.
    assert after.num_draft_tokens - before.num_draft_tokens <= 23 * NUM_DRAFTS
    seeded_alone = speculative.generate([prompts[1]], cold.clone(seed=5), use_tqdm=False)
    assert seeded_alone[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
