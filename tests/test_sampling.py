"""SamplingParams validation and the batched sampler's semantics (small vocabularies).

The sampler runs on CUDA when there is one, so a GPU machine also checks the device path
(pinned copies, device generators); every expectation holds on either device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from vacpack.engine.logprob_gather import gather_logprobs
from vacpack.engine.request_seeds import make_request_generator
from vacpack.engine.sampler import CDF_BLOCK, Sampler, SamplingRow
from vacpack.sampling import MAX_LOGPROBS, SamplingParams

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# A known distribution over 8 tokens, most likely first, for the support tests.
KNOWN_PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005]


def make_row(
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    suppress: frozenset[int] = frozenset(),
) -> SamplingRow:
    generator = None if params.seed is None else make_request_generator(params.seed, DEVICE)
    return SamplingRow(params, prompt, output, generator, suppress)


def known_logits(num_rows: int) -> torch.Tensor:
    return torch.tensor(KNOWN_PROBS, device=DEVICE).log().expand(num_rows, -1).contiguous()


def sampled_support(params: SamplingParams, num_draws: int = 3000) -> set[int]:
    sampler = Sampler(len(KNOWN_PROBS), DEVICE, seed=1)
    rows = [make_row(params) for _ in range(num_draws)]
    return set(sampler(known_logits(num_draws), rows).sampled_token_ids.tolist())


# ---------------------------------------------------------------- SamplingParams validation

INVALID_PARAMS: list[tuple[str, object, str]] = [
    ("n", 0, "n must be >= 1, got 0"),
    ("n", 1.5, "n must be an int"),
    ("n", True, "n must be an int"),
    (
        "temperature",
        -1.0,
        "temperature must be >= 0 (0 means greedy) and finite in float32, got -1.0",
    ),
    ("temperature", math.inf, "temperature must be"),
    ("temperature", math.nan, "temperature must be"),
    ("temperature", "hot", "temperature must be a real number, got 'hot'"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
    ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
    ("top_p", math.nan, "top_p must be in (0, 1]"),
    ("top_k", -2, "top_k must be -1 or >= 0"),
    ("top_k", 2.0, "top_k must be an int, got 2.0"),
    ("min_p", -0.1, "min_p must be in [0, 1], got -0.1"),
    ("min_p", 1.1, "min_p must be in [0, 1], got 1.1"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2.0, 2.0], got 2.5"),
    ("presence_penalty", -2.5, "presence_penalty must be in [-2.0, 2.0]"),
    ("frequency_penalty", -3.0, "frequency_penalty must be in [-2.0, 2.0], got -3.0"),
    ("frequency_penalty", None, "frequency_penalty must be a real number, got None"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("repetition_penalty", -1.0, "repetition_penalty must be > 0"),
    ("repetition_penalty", math.inf, "repetition_penalty must be > 0 and finite in float32"),
    ("repetition_penalty", 1e39, "repetition_penalty must be > 0 and finite in float32"),
    ("temperature", 1e39, "temperature must be >= 0 (0 means greedy) and finite in float32"),
    ("max_tokens", -1, "max_tokens must be None or >= 0 (0 means prompt only), got -1"),
    ("max_tokens", "16", "max_tokens must be an int or None"),
    ("min_tokens", -1, "min_tokens must be >= 0, got -1"),
    ("min_tokens", 17, "min_tokens must be <= max_tokens (16), got 17"),
    ("logprobs", -1, "logprobs must be None or in [0, 20], got -1"),
    ("logprobs", MAX_LOGPROBS + 1, "logprobs must be None or in [0, 20], got 21"),
    ("prompt_logprobs", 21, "prompt_logprobs must be None or in [0, 20], got 21"),
    ("prompt_logprobs", 1.0, "prompt_logprobs must be an int or None"),
    ("stop", "", "stop must be made of non-empty strings"),
    ("stop", ["ok", ""], "stop must be made of non-empty strings"),
    ("stop", 3, "stop must be a str, a list of str, or None, got 3"),
    ("stop", ["ok", 3], "stop must be a str, a list of str, or None"),
    ("stop_token_ids", [-1], "stop_token_ids must be a list of non-negative ints"),
    ("stop_token_ids", [1.0], "stop_token_ids must be a list of non-negative ints"),
    ("stop_token_ids", 7, "stop_token_ids must be a list of non-negative ints, or None, got 7"),
    ("seed", 1.5, "seed must be an int or None, got 1.5"),
    ("seed", "42", "seed must be an int or None"),
    ("seed", 2**64, "seed must be None or an int in"),
    ("ignore_eos", 1, "ignore_eos must be a bool, got 1"),
    ("skip_special_tokens", None, "skip_special_tokens must be a bool"),
]


@pytest.mark.parametrize(("field_name", "bad_value", "expected_message"), INVALID_PARAMS)
def test_invalid_params_name_the_field_and_value(
    field_name: str, bad_value: object, expected_message: str
) -> None:
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field_name: bad_value})  # type: ignore[arg-type]
    assert expected_message in str(error.value)


def test_defaults_match_vllm() -> None:
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (
        1,
        1.0,
        1.0,
        0,
        0.0,
    )
    assert (params.max_tokens, params.min_tokens, params.logprobs, params.seed) == (
        16,
        0,
        None,
        None,
    )
    assert params.stop == () and params.stop_token_ids == ()
    assert params.skip_special_tokens and params.spaces_between_special_tokens
    assert not params.ignore_eos and not params.include_stop_str_in_output


def test_normalisation() -> None:
    params = SamplingParams(
        top_k=-1, stop="###", stop_token_ids=[5, 6], temperature=1, max_tokens=0, min_tokens=0
    )
    assert params.top_k == 0
    assert params.stop == ("###",)
    assert params.stop_token_ids == (5, 6)
    assert isinstance(params.temperature, float)
    assert params.max_tokens == 0
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(temperature=1e-4).temperature == 0.01
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None
    hash(params)  # frozen and normalised to tuples, so usable as a key


def test_is_greedy_and_stop_helpers() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams().is_greedy
    eos = frozenset({2})
    params = SamplingParams(stop_token_ids=[7], min_tokens=3)
    assert params.all_stop_token_ids(eos) == {2, 7}
    assert SamplingParams(stop_token_ids=[7], ignore_eos=True).all_stop_token_ids(eos) == {7}
    assert params.stop_token_ids_to_suppress(2, eos) == {2, 7}
    assert params.stop_token_ids_to_suppress(3, eos) == frozenset()


def test_clone_applies_and_checks_changes() -> None:
    params = SamplingParams(temperature=0.5, stop="###")
    clone = params.clone(max_tokens=8)
    assert (clone.max_tokens, clone.temperature, clone.stop) == (8, 0.5, ("###",))
    assert params.max_tokens == 16  # the original is left as it was
    with pytest.raises(ValueError, match="top_p"):
        params.clone(top_p=2.0)


def test_child_params_offset_the_seed() -> None:
    params = SamplingParams(n=3, seed=10)
    assert [params.child_params(i).seed for i in range(3)] == [10, 11, 12]
    assert params.child_params(1).n == 1
    assert SamplingParams(n=2).child_params(1).seed is None
    # Past the largest seed the samples' seeds wrap around to the smallest, still valid ones.
    top = SamplingParams(n=3, seed=2**64 - 2)
    assert [top.child_params(i).seed for i in range(3)] == [2**64 - 2, 2**64 - 1, -(2**63)]


# ---------------------------------------------------------------- sampler


def test_greedy_is_argmax_after_penalties_only() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50).to(DEVICE)
    rows = [make_row(SamplingParams(temperature=0.0, top_p=0.1, min_p=0.5)) for _ in range(6)]
    output = Sampler(50, DEVICE, seed=0)(logits, rows)
    assert torch.equal(output.sampled_token_ids, logits.argmax(dim=-1))
    assert output.sampled_token_ids.dtype == torch.int64
    assert output.sampled_logprobs is None and output.topk_token_ids is None


def test_greedy_rows_mixed_with_random_rows() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 50).to(DEVICE)
    original = logits.clone()
    greedy_rows = {0, 3, 5}
    rows = [
        make_row(SamplingParams(temperature=0.0 if i in greedy_rows else 1.0)) for i in range(6)
    ]
    sampled = Sampler(50, DEVICE, seed=0)(logits, rows).sampled_token_ids
    for i in greedy_rows:
        assert sampled[i] == original[i].argmax()
    assert torch.equal(logits, original), "the caller's logits must not be modified"


def test_top_k_one_equals_greedy() -> None:
    torch.manual_seed(2)
    logits = torch.randn(8, 100).to(DEVICE)
    rows = [make_row(SamplingParams(top_k=1, temperature=1.0)) for _ in range(8)]
    sampled = Sampler(100, DEVICE, seed=3)(logits, rows).sampled_token_ids
    assert torch.equal(sampled, logits.argmax(dim=-1))


def run_seeded_steps(row_position: int, companions: list[SamplingParams]) -> list[int]:
    """Tokens of one seeded row over 25 steps, placed among ``companions`` in the batch."""
    vocab_size = 64
    seeded_params = SamplingParams(seed=1234, temperature=0.9)
    seeded_generator = make_request_generator(1234, DEVICE)
    sampler = Sampler(vocab_size, DEVICE, seed=len(companions))
    step_logits = torch.Generator().manual_seed(99)
    tokens = []
    for _ in range(25):
        seeded_logits = torch.randn(1, vocab_size, generator=step_logits).to(DEVICE)
        rows = [make_row(p) for p in companions]
        logits_rows = [torch.randn(1, vocab_size, device=DEVICE) for _ in companions]
        rows.insert(row_position, SamplingRow(seeded_params, (), (), seeded_generator, frozenset()))
        logits_rows.insert(row_position, seeded_logits)
        sampled = sampler(torch.cat(logits_rows), rows).sampled_token_ids
        tokens.append(int(sampled[row_position]))
    return tokens


def test_seeded_row_is_reproducible_and_independent_of_batch() -> None:
    alone = run_seeded_steps(0, [])
    assert alone == run_seeded_steps(0, [])
    companions = [
        SamplingParams(),
        SamplingParams(top_k=5, top_p=0.5, min_p=0.1, temperature=1.5),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=7),
        SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, logprobs=3),
    ]
    assert alone == run_seeded_steps(2, companions)
    assert alone == run_seeded_steps(5, companions)
    assert len(set(alone)) > 5, "a seeded row must still be random across steps"


def test_different_seeds_give_different_tokens() -> None:
    logits = torch.zeros(2, 1000, device=DEVICE)
    rows = [make_row(SamplingParams(seed=1)), make_row(SamplingParams(seed=2))]
    sampled = Sampler(1000, DEVICE)(logits, rows).sampled_token_ids
    assert sampled[0] != sampled[1]


@pytest.mark.parametrize(("seed", "other"), [(-1, 2**32 - 1), (0, 2**32), (5, 2**63 + 5)])
def test_seeds_differing_only_in_high_bits_differ(seed: int, other: int) -> None:
    # torch's CPU generator keeps a seed's low 32 bits; the request's whole seed must count.
    draws = [
        torch.rand(8, generator=make_request_generator(s, DEVICE), device=DEVICE).tolist()
        for s in (seed, other, seed)
    ]
    assert draws[0] != draws[1] and draws[0] == draws[2]


def test_a_seed_below_2_32_draws_what_torch_draws_with_it() -> None:
    # Seeds a client used before keep their samples.
    expected = torch.rand(8, generator=torch.Generator(DEVICE).manual_seed(1234), device=DEVICE)
    drawn = torch.rand(8, generator=make_request_generator(1234, DEVICE), device=DEVICE)
    assert torch.equal(drawn, expected)


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=3), {0, 1, 2}),
        # Mass before each token: 0, .4, .65, .8: the prefix that reaches .75 is 3 tokens.
        (SamplingParams(top_p=0.75), {0, 1, 2}),
        (SamplingParams(top_p=0.3), {0}),
        # Threshold 0.3 * 0.4 = 0.12 keeps probabilities 0.4, 0.25, 0.15.
        (SamplingParams(min_p=0.3), {0, 1, 2}),
        # top_p sees the top-4 distribution renormalised: .444, .278, ...: mass before the
        # third token is .722 >= .5.
        (SamplingParams(top_k=4, top_p=0.5), {0, 1}),
        (SamplingParams(top_k=2, min_p=0.01), {0, 1}),
        (SamplingParams(), set(range(8))),
        (SamplingParams(top_k=-1, top_p=1.0, min_p=0.0), set(range(8))),
    ],
)
def test_filters_restrict_the_support(params: SamplingParams, allowed: set[int]) -> None:
    assert sampled_support(params) == allowed


def test_filters_leave_unfiltered_rows_untouched_in_the_same_batch() -> None:
    sampler = Sampler(len(KNOWN_PROBS), DEVICE, seed=5)
    num_draws = 3000
    # top_p applies to the distribution renormalised over the top 3 (.5, .3125, .1875).
    rows = [make_row(SamplingParams(top_k=3, top_p=0.7)) for _ in range(num_draws)]
    rows += [make_row(SamplingParams()) for _ in range(num_draws)]
    sampled = sampler(known_logits(2 * num_draws), rows).sampled_token_ids
    assert set(sampled[:num_draws].tolist()) == {0, 1}
    assert set(sampled[num_draws:].tolist()) == set(range(8))


def test_penalties_match_hand_computed_logits() -> None:
    raw = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]], device=DEVICE)
    penalised = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    rows = [
        make_row(penalised, prompt=[0, 1], output=[2, 2, 3]),
        make_row(SamplingParams(), prompt=[0, 1], output=[2, 2, 3]),
    ]
    processed = Sampler(5, DEVICE).processed_logits(raw, rows)
    # token 0: prompt only, positive: 2 / 2; no frequency/presence (those see output only)
    # token 1: prompt only, negative: -1 * 2
    # token 2: output twice: 0.5 / 2 - 0.5 * 2 - 0.25
    # token 3: output once:  3 / 2 - 0.5 * 1 - 0.25
    # token 4: never seen
    expected = torch.tensor([1.0, -2.0, -1.0, 0.75, -2.0], device=DEVICE)
    torch.testing.assert_close(processed[0], expected)
    assert torch.equal(processed[1], raw[1])


def test_negative_presence_and_frequency_encourage_repeats() -> None:
    raw = torch.zeros(1, 4, device=DEVICE)
    params = SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5)
    processed = Sampler(4, DEVICE).processed_logits(raw, [make_row(params, output=[1, 1, 3])])
    torch.testing.assert_close(processed[0], torch.tensor([0.0, 2.0, 0.0, 1.5], device=DEVICE))


def test_min_tokens_suppresses_stop_tokens() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0], [0.0, 5.0, 4.0, 1.0]], device=DEVICE)
    eos = frozenset({1})
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    rows = [
        make_row(params, output=[0], suppress=params.stop_token_ids_to_suppress(1, eos)),
        make_row(params, output=[0, 0], suppress=params.stop_token_ids_to_suppress(2, eos)),
    ]
    sampler = Sampler(4, DEVICE)
    assert sampler(logits, rows).sampled_token_ids.tolist() == [3, 1]
    processed = sampler.processed_logits(logits, rows)
    assert processed[0, 1] == -math.inf and processed[0, 2] == -math.inf
    assert torch.equal(processed[1], logits[1])


def test_min_tokens_suppression_holds_for_random_rows() -> None:
    rows = [make_row(SamplingParams(), suppress=frozenset({0, 1})) for _ in range(2000)]
    support = set(
        Sampler(len(KNOWN_PROBS), DEVICE, seed=0)(
            known_logits(2000), rows
        ).sampled_token_ids.tolist()
    )
    assert support == set(range(2, 8))


def test_logprobs_come_from_raw_logits_with_ranks() -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, 30).to(DEVICE)
    rows = [
        make_row(SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.7), output=[1]),
        make_row(SamplingParams(logprobs=0, presence_penalty=2.0), output=[2, 3]),
        make_row(SamplingParams(temperature=0.0)),
        make_row(SamplingParams(logprobs=2, seed=9)),
    ]
    output = Sampler(30, DEVICE, seed=0)(logits, rows)
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    sampled = output.sampled_token_ids
    assert output.sampled_logprobs is not None and output.sampled_ranks is not None
    assert output.topk_token_ids is not None and output.topk_logprobs is not None
    torch.testing.assert_close(
        output.sampled_logprobs, raw_logprobs.gather(1, sampled[:, None])[:, 0]
    )
    expected_ranks = [
        int((raw_logprobs[i] > raw_logprobs[i, sampled[i]]).sum()) + 1 for i in range(4)
    ]
    assert output.sampled_ranks.tolist() == expected_ranks
    assert output.sampled_ranks[2] == 1  # greedy row without penalties picks the top token
    top_logprobs, top_ids = raw_logprobs.topk(5, dim=1)
    assert output.topk_token_ids.shape == (4, 5)
    assert torch.equal(output.topk_token_ids, top_ids)
    torch.testing.assert_close(output.topk_logprobs, top_logprobs)


def test_gather_logprobs_ranks_ties_behind() -> None:
    logprobs = torch.log_softmax(torch.tensor([[1.0, 3.0, 3.0, 0.0]]), dim=-1)
    gathered = gather_logprobs(logprobs, torch.tensor([0]), 2)
    assert gathered.token_ranks.tolist() == [3]
    assert gather_logprobs(logprobs, torch.tensor([3]), 0).token_ranks.tolist() == [4]
    assert gather_logprobs(logprobs, torch.tensor([3]), 0).topk_token_ids.shape == (1, 0)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 2.0])
def test_temperature_sampling_matches_target_distribution(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], device=DEVICE)
    num_draws = 20_000
    rows = [make_row(SamplingParams(temperature=temperature)) for _ in range(num_draws)]
    batch = logits.expand(num_draws, -1).contiguous()
    sampled = Sampler(6, DEVICE, seed=11)(batch, rows).sampled_token_ids
    observed = torch.bincount(sampled, minlength=6).double()
    expected = torch.softmax(logits.double() / temperature, dim=0) * num_draws
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    # 5 degrees of freedom: P(chi2 > 25) < 2e-4 for a correct sampler; the seed fixes the draw.
    assert chi_square < 25.0, (observed.tolist(), expected.tolist())


def test_sampling_across_cdf_blocks_matches_the_distribution() -> None:
    """A vocabulary of several CDF blocks, the allowed tokens at and beside block edges, every
    other token forbidden: the draws follow the distribution and never pick a forbidden one."""
    vocab_size = 2 * CDF_BLOCK + 452
    allowed = [0, CDF_BLOCK - 1, CDF_BLOCK, CDF_BLOCK + 1, 2 * CDF_BLOCK, vocab_size - 1]
    logits = torch.full((vocab_size,), float("-inf"), device=DEVICE)
    logits[allowed] = torch.tensor([0.5, 1.0, -0.5, 0.0, 1.5, -1.0], device=DEVICE)
    num_draws = 20_000
    rows = [make_row(SamplingParams(temperature=1.0)) for _ in range(num_draws)]
    batch = logits.expand(num_draws, -1).contiguous()
    sampled = Sampler(vocab_size, DEVICE, seed=5)(batch, rows).sampled_token_ids
    counts = torch.bincount(sampled, minlength=vocab_size).double()
    assert counts.sum() == counts[allowed].sum()  # nothing outside the allowed tokens
    expected = torch.softmax(logits[allowed].double(), dim=0) * num_draws
    chi_square = float(((counts[allowed] - expected) ** 2 / expected).sum())
    # 5 degrees of freedom, as above.
    assert chi_square < 25.0, (counts[allowed].tolist(), expected.tolist())


def test_rejects_logits_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler(10, DEVICE)(torch.zeros(1, 11, device=DEVICE), [make_row(SamplingParams())])


def test_empty_batch() -> None:
    output = Sampler(10, DEVICE)(torch.zeros(0, 10, device=DEVICE), [])
    assert output.sampled_token_ids.shape == (0,)
