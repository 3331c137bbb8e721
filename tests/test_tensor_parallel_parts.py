"""The pieces of tensor parallelism that need no second process: which KV heads a rank holds,
a step's inputs as integers, and the control channel (two ranks as two threads)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from vacpack.attention.backend import BatchLayout
from vacpack.distributed.collectives import LOOPBACK, new_backend
from vacpack.distributed.control import INITIAL_CAPACITY_INTS, ControlChannel, Program
from vacpack.engine import step_inputs
from vacpack.engine.step_inputs import StepInputs
from vacpack.models.parallel import TensorParallel, kv_head_rows


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "size"), [(8, 8, 4), (8, 2, 4), (8, 1, 2)])
def test_each_rank_holds_the_kv_heads_its_query_heads_read(
    num_heads: int, num_kv_heads: int, size: int
) -> None:
    head_dim = 4
    group_size = num_heads // num_kv_heads
    for rank in range(size):
        tp = TensorParallel(rank, size)
        rows = kv_head_rows(num_kv_heads, head_dim, tp)
        held = range(rows.start // head_dim, (rows.start + rows.length) // head_dim)
        queries = tp.even_rows(num_heads, "attention heads")
        local_group_size = queries.length // len(held)  # what the rank's attention groups by
        for local in range(queries.length):
            # Local query head j reads local KV head j // local_group_size: that must be the
            # KV head its checkpoint query head reads.
            assert held[local // local_group_size] == (queries.start + local) // group_size


def test_kv_heads_that_neither_split_nor_replicate_are_refused() -> None:
    with pytest.raises(ValueError, match="can neither be split over nor replicated"):
        kv_head_rows(2, 16, TensorParallel(0, 3))
    with pytest.raises(ValueError, match=r"key/value heads \(6\) is not divisible"):
        kv_head_rows(6, 16, TensorParallel(0, 4))


def test_step_inputs_survive_the_trip_through_integers() -> None:
    inputs = StepInputs(
        token_ids=[-3, 17, 5, 6, 7],
        positions=[9, 0, 1, 2, 3],
        # A decode whose first page fell behind a sliding window (-1), then a prefill chunk.
        layout=BatchLayout([1, 4], [10, 4], [[-1, 4, 9], [2]], 4, attention_windows=(8, None)),
        use_graph=False,
        sample_rows=[0, 4],
        future_slots=[5, 6],
        prompt_passes=[(1, 3)],
        shares_sampled_tokens=True,
    )
    decoded = step_inputs.decode(step_inputs.encode(inputs), 4, (8, None))
    assert decoded == inputs


def test_a_message_larger_than_the_channel_grows_it_on_every_rank() -> None:
    timeout = timedelta(seconds=10)
    master = dist.TCPStore(LOOPBACK, 0, 2, is_master=True, wait_for_workers=False, timeout=timeout)
    channels: dict[int, ControlChannel] = {}

    def join(rank: int) -> None:
        # A store client of its own: a client's wait holds its connection, so a rank sharing
        # one could not publish its address while the other waits for it.
        store = master if rank == 0 else dist.TCPStore(LOOPBACK, master.port, 2, timeout=timeout)
        backend = new_backend(store, "control", rank, 2, "cpu", timeout)
        channels[rank] = ControlChannel(backend, rank)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    large = list(range(3 * INITIAL_CAPACITY_INTS))
    received: list[tuple[Program, list[int]]] = []

    def receive_two() -> None:
        for _ in range(2):
            kind, payload = channels[1].receive()
            received.append((kind, payload.tolist()))

    receiver = threading.Thread(target=receive_two)
    receiver.start()
    channels[0].send(Program.ENGINE_STEP, large)
    channels[0].send(Program.LM_HEAD, torch.tensor([7]))
    receiver.join()
    assert received == [(Program.ENGINE_STEP, large), (Program.LM_HEAD, [7])]
    assert channels[0].capacity_ints == channels[1].capacity_ints > len(large)
