"""Per-request sampling parameters, with vLLM's names, defaults and meanings.

Every check lives in ``__post_init__`` so a bad request fails when it is built, with a message
that names the field, the value given and the allowed range, rather than deep inside a batched
device op where the culprit request can no longer be told apart from the others.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from vacpack.outputs import RequestOutputKind
from vacpack.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# vLLM's default ``max_logprobs``: asking for more top candidates than this is refused.
MAX_LOGPROBS = 20

# Below this temperature, dividing logits by it can overflow float32 to inf (and inf - inf is
# nan in the softmax), so, as vLLM does, a tiny positive temperature is raised to this floor.
MIN_POSITIVE_TEMPERATURE = 0.01

# torch.Generator.manual_seed accepts exactly this inclusive range.
_MIN_SEED = -(2**63)
_MAX_SEED = 2**64 - 1

_PENALTY_LIMIT = 2.0

# The sampler computes in float32: a temperature or repetition penalty past its largest finite
# value would become inf there, and inf * 0 or -inf / inf is nan in the logits.
_FLOAT32_MAX = 3.4028234663852886e38

# OpenAI's range for a logit_bias value: -100 bans a token, +100 all but forces it.
_LOGIT_BIAS_LIMIT = 100.0


def _is_int(value: object) -> bool:
    # bool is an int subclass, but True as a count or an id is always a caller's mistake.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _fail(field_name: str, requirement: str, value: object) -> ValueError:
    return ValueError(f"{field_name} must be {requirement}, got {value!r}")


def check_truncate_prompt_tokens(value: object, max_num_tokens: int | None = None) -> None:
    """ValueError unless `value` is a valid vLLM ``truncate_prompt_tokens``: None (keep every
    prompt token), -1 (as many as the context holds) or a count k >= 1, and at most
    `max_num_tokens` where that limit is given: once the model is known, a k above its context
    is refused, as vLLM refuses it (for pooling and generation alike), even where the prompt is
    short enough for k not to matter."""
    if value is None:
        return
    if not _is_int(value):
        raise _fail("truncate_prompt_tokens", "None or an int", value)
    count = int(cast(numbers.Integral, value))
    if max_num_tokens is None:
        if not (count == -1 or count >= 1):
            raise _fail("truncate_prompt_tokens", "None, -1 (the context's limit) or >= 1", value)
    elif not (count == -1 or 1 <= count <= max_num_tokens):
        raise _fail(
            "truncate_prompt_tokens",
            f"None, -1 (the context's limit) or in [1, {max_num_tokens}] (max_model_len)",
            value,
        )


def prompt_tokens_to_keep(truncate_prompt_tokens: int | None, limit: int) -> int | None:
    """How many prompt tokens a checked ``truncate_prompt_tokens`` keeps where at most `limit`
    fit: None keeps them all, -1 keeps `limit`, k keeps k."""
    return limit if truncate_prompt_tokens == -1 else truncate_prompt_tokens


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each generated token of one request, and when to stop.

    Names, defaults and meanings follow vLLM's ``SamplingParams``, with these differences:

    - ``top_k=-1`` is accepted and stored as 0; both mean "no top-k limit".
    - ``max_tokens=0`` is accepted and means "prompt only": nothing is generated (useful with
      ``prompt_logprobs``). ``None`` means "until a stop condition or the context is full".
    - ``stop`` and ``stop_token_ids`` are always stored as tuples (empty when not given), so
      the object stays hashable and consumers need no ``None`` checks.
    - A temperature in (0, 0.01) is raised to 0.01, as vLLM does, to keep float32 finite.
    - ``logprobs`` and ``prompt_logprobs`` are capped at ``MAX_LOGPROBS`` (20).
    - ``truncate_prompt_tokens=k`` keeps a prompt's last k tokens (left truncation, as vLLM);
      ``-1`` keeps as many as the context holds with room for one output token.
    - ``logit_bias`` (token id -> a value in [-100, 100] added to its logit), ``allowed_token_ids``
      and ``bad_words`` are stored as a dict with int keys and as tuples;
      ``structured_outputs`` may also be given as a dict of StructuredOutputsParams' fields.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    # Given as a str or a list of str; stored as a tuple of str.
    stop: str | Sequence[str] | None = None
    # Given as a list of int; stored as a tuple of int.
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Given as a mapping of token id -> bias.
    logit_bias: Mapping[int, float] | None = None
    # Given as a list of int; stored as a tuple of int. Only these tokens may be sampled.
    allowed_token_ids: Sequence[int] | None = None
    # Given as a list of str; stored as a tuple of str. Never generated (as vLLM: each word's
    # last token is banned where the output so far ends with the rest of the word).
    bad_words: Sequence[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._normalise_types()
        self._check_ranges()
        self._normalise_stops()
        self._normalise_token_controls()

    def _set(self, field_name: str, value: Any) -> None:
        # The dataclass is frozen for callers; normalisation here is the one sanctioned write.
        object.__setattr__(self, field_name, value)

    def _normalise_types(self) -> None:
        for field_name in ("n", "top_k", "min_tokens"):
            value = getattr(self, field_name)
            if not _is_int(value):
                raise _fail(field_name, "an int", value)
            self._set(field_name, int(value))
        for field_name in (
            "max_tokens",
            "logprobs",
            "prompt_logprobs",
            "seed",
            "truncate_prompt_tokens",
        ):
            value = getattr(self, field_name)
            if value is not None and not _is_int(value):
                raise _fail(field_name, "an int or None", value)
            self._set(field_name, None if value is None else int(value))
        for field_name in (
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "temperature",
            "top_p",
            "min_p",
        ):
            value = getattr(self, field_name)
            if not _is_real(value):
                raise _fail(field_name, "a real number", value)
            self._set(field_name, float(value))
        for field_name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            value = getattr(self, field_name)
            if not isinstance(value, bool):
                raise _fail(field_name, "a bool", value)

    def _check_ranges(self) -> None:
        # Comparisons are written so that nan fails them: `not (lo <= x <= hi)`.
        if self.n < 1:
            raise _fail("n", ">= 1", self.n)
        if not (0 <= self.temperature <= _FLOAT32_MAX):
            raise _fail(
                "temperature", ">= 0 (0 means greedy) and finite in float32", self.temperature
            )
        if 0 < self.temperature < MIN_POSITIVE_TEMPERATURE:
            logger.warning(
                "temperature %s is below %s; raised to %s to keep the logits finite",
                self.temperature,
                MIN_POSITIVE_TEMPERATURE,
                MIN_POSITIVE_TEMPERATURE,
            )
            self._set("temperature", MIN_POSITIVE_TEMPERATURE)
        if not (0 < self.top_p <= 1):
            raise _fail("top_p", "in (0, 1]", self.top_p)
        if self.top_k < -1:
            raise _fail("top_k", "-1 or >= 0 (0 and -1 disable top-k)", self.top_k)
        if self.top_k == -1:
            self._set("top_k", 0)
        if not (0 <= self.min_p <= 1):
            raise _fail("min_p", "in [0, 1]", self.min_p)
        for field_name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, field_name)
            if not (-_PENALTY_LIMIT <= value <= _PENALTY_LIMIT):
                raise _fail(field_name, f"in [{-_PENALTY_LIMIT}, {_PENALTY_LIMIT}]", value)
        if not (0 < self.repetition_penalty <= _FLOAT32_MAX):
            raise _fail(
                "repetition_penalty",
                "> 0 and finite in float32 (1 disables it)",
                self.repetition_penalty,
            )
        if self.max_tokens is not None and self.max_tokens < 0:
            raise _fail("max_tokens", "None or >= 0 (0 means prompt only)", self.max_tokens)
        if self.min_tokens < 0:
            raise _fail("min_tokens", ">= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _fail("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        for field_name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field_name)
            if value is not None and not (0 <= value <= MAX_LOGPROBS):
                raise _fail(field_name, f"None or in [0, {MAX_LOGPROBS}]", value)
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.seed is not None and not (_MIN_SEED <= self.seed <= _MAX_SEED):
            raise _fail("seed", "None or an int in [-2**63, 2**64 - 1]", self.seed)

    def _normalise_stops(self) -> None:
        stop = self.stop
        if stop is None:
            stop_strings: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stop_strings = (stop,)
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stop_strings = tuple(stop)
        else:
            raise _fail("stop", "a str, a list of str, or None", stop)
        if any(s == "" for s in stop_strings):
            raise _fail("stop", "made of non-empty strings", stop)
        self._set("stop", stop_strings)

        stop_ids = self.stop_token_ids
        if stop_ids is None:
            stop_id_tuple: tuple[int, ...] = ()
        elif isinstance(stop_ids, (list, tuple)) and all(_is_int(i) and i >= 0 for i in stop_ids):
            stop_id_tuple = tuple(int(i) for i in stop_ids)
        else:
            raise _fail("stop_token_ids", "a list of non-negative ints, or None", stop_ids)
        self._set("stop_token_ids", stop_id_tuple)

    def _normalise_token_controls(self) -> None:
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, Mapping):
                raise _fail("logit_bias", "a mapping of token id -> bias", bias)
            normalised: dict[int, float] = {}
            for token_id, value in bias.items():
                if not (_is_int(token_id) and token_id >= 0):
                    raise _fail("logit_bias", "keyed by non-negative token ids", token_id)
                if not (_is_real(value) and -_LOGIT_BIAS_LIMIT <= value <= _LOGIT_BIAS_LIMIT):
                    raise _fail(
                        "logit_bias",
                        f"made of values in [{-_LOGIT_BIAS_LIMIT:g}, {_LOGIT_BIAS_LIMIT:g}]",
                        value,
                    )
                normalised[int(token_id)] = float(value)
            self._set("logit_bias", normalised or None)
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not (
                isinstance(allowed, (list, tuple))
                and allowed
                and all(_is_int(i) and i >= 0 for i in allowed)
            ):
                raise _fail("allowed_token_ids", "a non-empty list of non-negative ints", allowed)
            self._set("allowed_token_ids", tuple(int(i) for i in allowed))
        bad_words = self.bad_words
        if bad_words is not None:
            if not (
                isinstance(bad_words, (list, tuple))
                and all(isinstance(w, str) and w.strip() for w in bad_words)
            ):
                raise _fail("bad_words", "a list of non-blank strings", bad_words)
            self._set("bad_words", tuple(bad_words) or None)
        structured = self.structured_outputs
        if structured is not None and not isinstance(structured, StructuredOutputsParams):
            self._set("structured_outputs", StructuredOutputsParams.from_dict(structured))

    @property
    def constrains_tokens(self) -> bool:
        """True when a token mask or bias applies: a grammar, allowed or banned tokens, bias."""
        return (
            self.structured_outputs is not None
            or self.allowed_token_ids is not None
            or self.bad_words is not None
            or self.logit_bias is not None
        )

    @property
    def is_greedy(self) -> bool:
        """True when the next token is always the most likely one after penalties."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when sampling reads the tokens generated so far (repetition, frequency or
        presence penalty)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def all_stop_token_ids(self, eos_token_ids: frozenset[int]) -> frozenset[int]:
        """Token ids that finish this request: ``stop_token_ids``, plus EOS unless ignored."""
        stop_ids = frozenset(self.stop_token_ids or ())
        return stop_ids if self.ignore_eos else stop_ids | eos_token_ids

    def stop_token_ids_to_suppress(
        self, num_output_tokens: int, eos_token_ids: frozenset[int]
    ) -> frozenset[int]:
        """Ids to forbid at the next step so that at least ``min_tokens`` get generated."""
        if num_output_tokens >= self.min_tokens:
            return frozenset()
        return self.all_stop_token_ids(eos_token_ids)

    def truncate_prompt(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt the model reads: its last ``truncate_prompt_tokens`` tokens (-1: the
        last max_model_len - 1), or all of it when that is None. ValueError naming the field
        for a ``truncate_prompt_tokens`` above max_model_len: only here is the model known."""
        check_truncate_prompt_tokens(self.truncate_prompt_tokens, max_model_len)
        # -1 leaves room for the one output token every request generates.
        keep = prompt_tokens_to_keep(self.truncate_prompt_tokens, max_model_len - 1)
        if keep is None or len(prompt_token_ids) <= keep:
            return prompt_token_ids
        return prompt_token_ids[-keep:]

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy, with `changes` applied and checked (vLLM's name; SamplingParams is frozen, so
        `params.max_tokens = 8` raises: use `params.clone(max_tokens=8)`)."""
        return dataclasses.replace(self, **changes)

    def child_params(self, child_index: int) -> SamplingParams:
        """The params for one of the ``n`` samples: ``n=1``, and ``seed + child_index``.

        Without the seed offset, ``n`` seeded samples would be ``n`` copies of one sample.
        Past the largest seed the offset wraps around to the smallest (a seed the caller may
        give stays valid for every sample, not only for the first).
        """
        seed = None
        if self.seed is not None:
            seed = self.seed + child_index
            if seed > _MAX_SEED:
                seed -= _MAX_SEED - _MIN_SEED + 1
        # A shallow copy, not dataclasses.replace: these values were checked and normalised
        # when self was made, and checking them again for each of n samples cost 150 us each
        # (a request of 32 prompts x n=128 took 0.8 s to add, on the engine's thread).
        child = copy.copy(self)
        child._set("n", 1)
        child._set("seed", seed)
        return child
