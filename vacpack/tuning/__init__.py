"""Implementations chosen by measurement on the machine at hand, cached per CPU, torch, vacpack
and shapes (see choose.py)."""

from vacpack.tuning.allowance import FIRST_LOAD_TIMING_S, TimingAllowance, spending
from vacpack.tuning.audit import AuditedChoice, RecordedChoice, audit, recording
from vacpack.tuning.cache import CACHE_ENV, ChoiceCache, default_cache_dir
from vacpack.tuning.choose import DEFAULT_BUDGET_S, choose, force_env_var
from vacpack.tuning.record import ChoiceSource, MeasuredChoice

__all__ = [
    "CACHE_ENV",
    "DEFAULT_BUDGET_S",
    "FIRST_LOAD_TIMING_S",
    "AuditedChoice",
    "ChoiceCache",
    "ChoiceSource",
    "MeasuredChoice",
    "RecordedChoice",
    "TimingAllowance",
    "audit",
    "choose",
    "default_cache_dir",
    "force_env_var",
    "recording",
    "spending",
]
