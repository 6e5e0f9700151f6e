"""accelerate's own test scenarios (tests/test_memory_utils.py) against the drop-in, and the ones users
hit beyond them: evaluation functions with no optimizer step, a start known to fail, a second call.

Where the drop-in differs on purpose (it searches instead of stepping down by 10 %), the test says so.
"""

from __future__ import annotations

import pytest
import torch

from autobatch.integrations.accelerate import NoExecutableBatchSizeError, find_executable_batch_size


def fake_oom() -> None:
    raise RuntimeError("CUDA out of memory.")  # what accelerate's test helper raises


def test_start_zero_raises_accelerates_runtime_error_when_called():
    @find_executable_batch_size(starting_batch_size=0)  # applying the decorator is fine, as in accelerate
    def loop(batch_size):
        pass

    with pytest.raises(RuntimeError, match=r"^No executable batch size found, reached zero\."):
        loop()


def test_approach_zero_raises_accelerates_runtime_error():
    @find_executable_batch_size(starting_batch_size=16)
    def loop(batch_size):
        if batch_size > 0:
            fake_oom()

    with pytest.raises(RuntimeError, match=r"^No executable batch size found, reached zero\.") as caught:
        loop()
    assert isinstance(caught.value, NoExecutableBatchSizeError)


def test_passing_the_batch_size_raises_accelerates_type_error():
    @find_executable_batch_size(starting_batch_size=128)
    def f(batch_size, arg1, arg2):
        pass

    # accelerate's own test expects quotes (arg1='hello'), in an assertion placed after the raising call,
    # which never runs; accelerate writes arg1=hello, and so does the drop-in.
    with pytest.raises(TypeError, match=r"Batch size was passed into `f`.*`f\(arg1=hello, arg2=world\)`"):
        f(128, "hello", "world")


def test_any_other_error_is_the_same_object():
    raised = ValueError("Oops, we had an error!")

    @find_executable_batch_size(starting_batch_size=16)
    def loop(batch_size):
        raise raised

    with pytest.raises(ValueError) as caught:
        loop()
    assert caught.value is raised


def test_an_explicit_argument_reaches_the_function_and_its_result_comes_back():
    @find_executable_batch_size(starting_batch_size=128)
    def loop(batch_size, arg1):
        if batch_size > 8:
            fake_oom()
        return batch_size, arg1

    assert loop("hello") == (8, "hello")  # accelerate's test_memory_explicit, on a monotone device


def test_an_evaluation_function_with_no_optimizer_step_is_searched_by_whole_calls():
    calls: list[int] = []

    @find_executable_batch_size(starting_batch_size=64)
    def evaluate(batch_size):
        calls.append(batch_size)
        with torch.no_grad():
            if batch_size > 20:
                fake_oom()
            return torch.nn.Linear(4, 2)(torch.randn(batch_size, 4)).shape[0]

    assert evaluate() == 20  # accelerate gives 19 (64 × 0.9…); it was 1 here before
    fits = {t.batch: t.fits for t in evaluate.trials}
    assert fits[20] and not fits[21]
    assert calls.count(20) == 1  # the trial at 20 ran the whole call: its result is the answer, not run again
    assert len(calls) <= 10


def test_a_start_known_to_fail_bounds_a_pass_fail_search():
    calls: list[int] = []

    @find_executable_batch_size(starting_batch_size=1024)
    def loop(batch_size):
        calls.append(batch_size)
        if batch_size > 700:
            fake_oom()
        return batch_size

    assert loop() == 700
    assert max(calls[1:]) < 1024 and len(calls) <= 15  # bisected below 1024: it doubled up to 512 first (20 calls)


def test_a_second_call_with_the_same_arguments_runs_once_at_the_answer():
    calls: list[int] = []
    data = [1, 2, 3]

    @find_executable_batch_size(starting_batch_size=64)
    def loop(batch_size, rows):
        calls.append(batch_size)
        if batch_size > 20:
            fake_oom()
        return batch_size

    assert loop(data) == 20
    first = len(calls)
    assert loop(data) == 20 and calls[first:] == [20]  # as accelerate: it keeps the batch it came down to
    assert loop([4, 5]) == 20 and len(calls) > first + 1  # other arguments: searched again


def test_reduce_batch_size_fn_is_what_a_later_out_of_memory_error_falls_back_to():
    calls: list[int] = []
    failed = {"once": False}

    @find_executable_batch_size(starting_batch_size=64, reduce_batch_size_fn=lambda: 10)
    def train(batch_size):
        calls.append(batch_size)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            if batch_size > 20:
                fake_oom()
            if batch_size == 20 and step == 2 and not failed["once"]:  # past a trial's 2 steps: the real run
                failed["once"] = True
                fake_oom()
            model(torch.randn(batch_size, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return batch_size

    assert train() == 10  # the search found 20; its real run hit a rare long batch: reduce_batch_size_fn said 10
    assert calls[-2:] == [20, 10]
