"""The LLM API: sampling controls, stop conditions, n > 1, chat, and bad input."""

from __future__ import annotations

import json

import pytest
import torch

from vacpack import LLM, SamplingParams
from vacpack.engine.engine import EngineStalledError


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(
        str(tiny_checkpoint("qwen2")), dtype="float32", block_size=8, max_num_batched_tokens=128
    )


def _random_prompts(llm: LLM, num_prompts: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    vocab_size = llm.loaded.config.vocab_size
    return [
        torch.randint(0, vocab_size, (int(n),), generator=generator).tolist()
        for n in torch.randint(3, 60, (num_prompts,), generator=generator)
    ]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_outputs_come_back_in_input_order(llm: LLM) -> None:
    prompts = _random_prompts(llm, 6, seed=0)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts


def test_no_prompts_give_no_outputs(llm: LLM) -> None:
    assert llm.generate([], use_tqdm=False) == []
    assert llm.chat([], use_tqdm=False) == []


def test_vllm_prompt_types_are_read(llm: LLM) -> None:
    from vacpack import TextPrompt, TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=4)
    token_ids = llm.get_tokenizer().encode("The weather today is")
    as_text, as_tokens = llm.generate(
        [TextPrompt(prompt="The weather today is"), TokensPrompt(prompt_token_ids=token_ids)],
        params,
        use_tqdm=False,
    )
    assert as_text.prompt_token_ids == as_tokens.prompt_token_ids == token_ids
    assert as_text.outputs[0].token_ids == as_tokens.outputs[0].token_ids


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm: LLM) -> None:
    prompt = _random_prompts(llm, 1, seed=1)[0]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = _tokens(llm.generate([prompt], seeded, use_tqdm=False))[0]
    others = _random_prompts(llm, 7, seed=2)
    mixed_params = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)] * 7
    mixed = llm.generate([*others, prompt], [*mixed_params, seeded], use_tqdm=False)
    assert mixed[-1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=24, ignore_eos=True)
    assert _tokens(llm.generate([prompt], other_seed, use_tqdm=False))[0] != alone


def test_top_k_one_equals_greedy(llm: LLM) -> None:
    prompts = _random_prompts(llm, 4, seed=3)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    top1 = llm.generate(
        prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=10), use_tqdm=False
    )
    assert _tokens(greedy) == _tokens(top1)


def test_n_returns_n_distinct_seeded_samples(llm: LLM) -> None:
    prompt = _random_prompts(llm, 1, seed=4)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in output.outputs]
    assert len(set(samples)) == 3
    (again,) = llm.generate([prompt], params, use_tqdm=False)
    assert [tuple(c.token_ids) for c in again.outputs] == samples


def test_max_tokens_and_context_limit_finish_with_length(tiny_checkpoint) -> None:
    small = LLM(str(tiny_checkpoint("qwen2")), dtype="float32", max_model_len=40)
    prompt = list(range(10, 40))  # 30 tokens: 10 left in the context
    (capped,) = small.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )
    assert len(capped.outputs[0].token_ids) == 5
    assert capped.outputs[0].finish_reason == "length"
    (at_limit,) = small.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    )
    assert len(at_limit.outputs[0].token_ids) == 10
    assert at_limit.outputs[0].finish_reason == "length"


def test_stop_token_ids_cut_where_they_should(llm: LLM) -> None:
    prompt = _random_prompts(llm, 1, seed=6)[0]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = _tokens(llm.generate([prompt], params, use_tqdm=False))[0]
    stop_id = reference[5]
    first = reference.index(stop_id)
    (output,) = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )
    completion = output.outputs[0]
    assert completion.token_ids == reference[: first + 1]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == stop_id


def test_min_tokens_holds_a_favoured_stop_token_back_until_then(llm: LLM) -> None:
    """A stop token biased far above every other wins each step it is allowed: the first
    min_tokens steps it is suppressed, the next one it ends the sequence (each sequence's
    sampler row changes state between the two)."""
    stop_id = 7
    params = SamplingParams(
        temperature=0,
        max_tokens=12,
        min_tokens=3,
        stop_token_ids=[stop_id],
        logit_bias={stop_id: 100.0},
    )
    outputs = llm.generate(_random_prompts(llm, 3, seed=5), params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert stop_id not in completion.token_ids[:3]
        assert completion.token_ids[3:] == [stop_id]
        assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_id)


def test_eos_from_generation_config_stops(tiny_checkpoint, tmp_path) -> None:
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("llama"), model_dir)
    llm = LLM(str(model_dir), dtype="float32")
    prompt = list(range(5, 25))
    reference = _tokens(
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    )[0]
    eos_id = reference[3]
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = [config["eos_token_id"], eos_id]
    config_path.write_text(json.dumps(config))
    with_eos = LLM(str(model_dir), dtype="float32")
    (output,) = with_eos.generate([prompt], SamplingParams(temperature=0, max_tokens=12))
    completion = output.outputs[0]
    assert completion.token_ids == reference[: reference.index(eos_id) + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", None)
    (ignored,) = with_eos.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    assert ignored.outputs[0].token_ids == reference


def test_stop_strings_cut_the_text(llm: LLM) -> None:
    prompt = "The weather today is"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (reference,) = llm.generate([prompt], params, use_tqdm=False)
    text = reference.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "the reference output should have text to cut"
    cut_at = text.index(stop)
    for include, expected in [(False, text[:cut_at]), (True, text[: cut_at + len(stop)])]:
        (output,) = llm.generate(
            [prompt],
            SamplingParams(
                temperature=0,
                max_tokens=24,
                ignore_eos=True,
                stop=[stop],
                include_stop_str_in_output=include,
            ),
            use_tqdm=False,
        )
        completion = output.outputs[0]
        assert completion.text == expected
        assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)


def test_a_stop_string_in_a_kept_stop_tokens_text_is_the_stop_reason(llm: LLM) -> None:
    """With include_stop_str_in_output the stop token's text is kept and searched for stop
    strings: one found there names itself as the stop reason, as in vLLM."""
    stop_id = llm.engine.loaded.tokenizer.encode(" the", add_special_tokens=False)[-1]
    stop = llm.engine.loaded.tokenizer.decode([stop_id])
    for include, text, stop_reason in [(False, "", stop_id), (True, stop, stop)]:
        params = SamplingParams(
            temperature=0,
            max_tokens=8,
            stop=[stop],
            stop_token_ids=[stop_id],
            logit_bias={stop_id: 100.0},
            include_stop_str_in_output=include,
        )
        (output,) = llm.generate(["hello"], params, use_tqdm=False)
        completion = output.outputs[0]
        assert (completion.text, completion.token_ids) == (text, [stop_id])
        assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_reason)


def test_sampled_logprobs_match_prompt_logprobs_of_the_same_text(llm: LLM) -> None:
    prompt = _random_prompts(llm, 1, seed=7)[0]
    (output,) = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
        use_tqdm=False,
    )
    completion = output.outputs[0]
    assert len(completion.logprobs) == 6
    full = prompt + completion.token_ids
    (rescored,) = llm.generate(
        [full], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    total = 0.0
    for i, token in enumerate(completion.token_ids):
        step = completion.logprobs[i]
        assert token in step and len(step) <= 3
        assert step[token].rank == 1  # greedy picks the most likely token
        expected = rescored.prompt_logprobs[len(prompt) + i][token].logprob
        assert step[token].logprob == pytest.approx(expected, abs=1e-4)
        total += step[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_chat_uses_the_chat_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Hello there!"}]
    params = SamplingParams(temperature=0, max_tokens=5)
    (chat_output,) = llm.chat(messages, params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant" in rendered
    (plain,) = llm.generate(
        [{"prompt_token_ids": chat_output.prompt_token_ids}], params, use_tqdm=False
    )
    assert chat_output.prompt_token_ids == tokenizer.encode(rendered)
    assert plain.outputs[0].token_ids == chat_output.outputs[0].token_ids


def test_chat_reads_messages_as_the_server_does(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=1)

    def prompt_ids(messages, **kwargs) -> list[int]:
        return llm.chat(messages, params, use_tqdm=False, **kwargs)[0].prompt_token_ids

    # Text parts, one per line; a template variable; a last message continued, not closed.
    parts = [{"type": "text", "text": "Line one."}, {"type": "text", "text": "Line two."}]
    joined = [{"role": "user", "content": "Line one.\nLine two."}]
    assert prompt_ids([{"role": "user", "content": parts}]) == prompt_ids(joined)
    template = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    greeted = prompt_ids(joined, chat_template=template, chat_template_kwargs={"greeting": "Hi! "})
    assert greeted == tokenizer.encode("Hi! Line one.\nLine two.")
    unfinished = [*joined, {"role": "assistant", "content": "The answer is"}]
    continued = prompt_ids(unfinished, add_generation_prompt=False, continue_final_message=True)
    rendered = tokenizer.apply_chat_template(
        unfinished, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert rendered.endswith("The answer is") and continued == tokenizer.encode(rendered)
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        prompt_ids(unfinished, continue_final_message=True)
    with pytest.raises(ValueError, match="only text parts are read"):
        prompt_ids([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


def test_multimodal_prompt_keys_are_refused_not_dropped(llm: LLM) -> None:
    prompt = {"prompt": "describe this", "multi_modal_data": {"image": object()}}
    with pytest.raises(ValueError, match=r"\['multi_modal_data'\] are not supported"):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([""], "empty"),
        ([[]], "empty"),
        ([[5] * 5000], "max_model_len"),
        ([[1, 2, 10**9]], "token ids must be integers"),
    ],
)
def test_bad_prompts_raise_clearly_and_the_engine_keeps_working(
    llm: LLM, prompts, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine prompt", *prompts], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    (output,) = llm.generate(
        ["still works"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False
    )
    assert len(output.outputs[0].token_ids) == 3


def test_bad_sampling_values_and_unknown_models(tmp_path) -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="no-such-model-dir"):
        LLM(str(tmp_path / "no-such-model-dir"))
    with pytest.raises(ValueError, match="not-a-real-org/not-a-real-model"):
        LLM("not-a-real-org/not-a-real-model")


def test_delta_outputs_add_up_to_the_final_output(llm: LLM) -> None:
    from vacpack.outputs import RequestOutputKind

    engine = llm.engine
    prompt = engine.loaded.tokenizer.encode("The weather today is")
    reference_params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (reference,) = llm.generate([prompt], reference_params, use_tqdm=False)
    text = reference.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(
        n=2, temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], logprobs=1,
        output_kind=RequestOutputKind.DELTA,
    )  # fmt: skip
    engine.add_request("delta", prompt, params)
    texts, token_ids, logprobs, finish = ["", ""], [[], []], [[], []], [None, None]
    while engine.has_unfinished_requests():
        for output in engine.step():
            for completion in output.outputs:
                assert stop not in completion.text  # never streamed, then taken back
                texts[completion.index] += completion.text
                token_ids[completion.index] += completion.token_ids
                logprobs[completion.index] += completion.logprobs
                finish[completion.index] = completion.finish_reason
    assert texts == [text[: text.index(stop)]] * 2
    assert finish == ["stop", "stop"]
    assert token_ids[0] == token_ids[1] and len(logprobs[0]) == len(token_ids[0])


def test_cumulative_outputs_keep_what_they_held_when_returned(llm: LLM) -> None:
    # Each streamed output owns its lists: the engine keeps appending to the sequence's.
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    engine.add_request("cumulative", _random_prompts(llm, 1, seed=9)[0], params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [output.outputs[0] for output in engine.step()]
    assert [len(output.token_ids) for output in outputs] == [1, 2, 3, 4, 5, 6]
    assert [len(output.logprobs) for output in outputs] == [1, 2, 3, 4, 5, 6]


def _stop_across_a_token_boundary(llm: LLM, token_ids: list[int], text: str) -> str:
    """Two characters of text, one either side of a token boundary, found nowhere earlier."""
    tokenizer = llm.engine.loaded.tokenizer
    for num_tokens in range(1, len(token_ids)):
        boundary = len(tokenizer.decode(token_ids[:num_tokens]))
        stop = text[boundary - 1 : boundary + 1]
        if len(stop) == 2 and "\ufffd" not in stop and text.index(stop) == boundary - 1:
            return stop
    raise AssertionError(f"no stop string to make from {text!r}")


def test_cumulative_outputs_never_show_text_a_stop_string_cuts(llm: LLM) -> None:
    # As in vLLM, a cumulative output leaves out the tail that may yet become a stop string:
    # the text of each output extends the one before.
    engine = llm.engine
    prompt = engine.loaded.tokenizer.encode("The weather today is")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (reference,) = llm.generate([prompt], params, use_tqdm=False)
    text = reference.outputs[0].text
    stop = _stop_across_a_token_boundary(llm, reference.outputs[0].token_ids, text)
    engine.add_request("cumulative-stop", prompt, params.clone(stop=[stop]))
    shown: list[str] = []
    while engine.has_unfinished_requests():
        shown += [output.outputs[0].text for output in engine.step()]
    final = text[: text.index(stop)]
    assert shown[-1] == final
    assert all(final.startswith(text_shown) for text_shown in shown), (shown, stop)


def test_vllm_enforce_eager_turns_cuda_graphs_off(tiny_checkpoint) -> None:
    model = str(tiny_checkpoint("qwen2"))
    eager = LLM(model, dtype="float32", max_model_len=64, enforce_eager=True)
    assert eager.config.enable_cuda_graphs is False
    with pytest.raises(TypeError, match="unknown engine arguments \\['swap_space'\\]"):
        LLM(model, dtype="float32", swap_space=4)


def test_a_stuck_engine_raises_instead_of_looping_forever(llm: LLM) -> None:
    pool = llm.engine.page_pool
    lost = pool.allocate(pool.num_free_pages)  # a planted bug: every KV page leaked
    params = SamplingParams(temperature=0, max_tokens=4)
    try:
        with pytest.raises(EngineStalledError, match=r"cannot run any of its 1 unfinished"):
            llm.generate([[5, 6, 7]], params, use_tqdm=False)
    finally:
        pool.free(lost)
    assert not llm.engine.has_unfinished_requests()  # the stuck request was taken out
    (output,) = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    prompt = _random_prompts(llm, 1, seed=9)[0] + list(range(5, 25))
    greedy = SamplingParams(temperature=0, max_tokens=4)
    (cut,) = llm.generate([prompt], greedy.clone(truncate_prompt_tokens=10), use_tqdm=False)
    (tail,) = llm.generate([prompt[-10:]], greedy, use_tqdm=False)
    assert cut.prompt_token_ids == prompt[-10:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    # -1: as much as the context holds, leaving room for one output token.
    max_model_len = llm.loaded.max_model_len
    too_long = (prompt * (max_model_len // len(prompt) + 2))[: max_model_len + 5]
    with pytest.raises(ValueError, match="prompt 0"):
        llm.generate([too_long], greedy, use_tqdm=False)
    (whole,) = llm.generate(
        [too_long], greedy.clone(max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False
    )
    assert whole.prompt_token_ids == too_long[-(max_model_len - 1) :]
    assert len(whole.outputs[0].token_ids) == 1
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_a_stop_string_completed_when_held_back_bytes_are_flushed(llm: LLM) -> None:
    """A lone UTF-8 lead byte is held back as an incomplete character until the output ends,
    then flushed as U+FFFD: a stop string it completes there stops the sequence on it."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    lead_byte = llm.get_tokenizer().convert_tokens_to_ids(bytes_to_unicode()[0xE4])
    params = SamplingParams(max_tokens=1, allowed_token_ids=[lead_byte], stop=["\ufffd"])
    (output,) = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.token_ids == [lead_byte]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "\ufffd")
    assert completion.text == ""
