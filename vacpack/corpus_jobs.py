"""LLM's corpus jobs, vLLM's pooling entry points and log-likelihoods: embed, score,
loglikelihood, classify and encode, each a packed job of the corpus runner."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vacpack.config import EngineConfig
from vacpack.inputs import PromptType, as_prompt_list, corpus_input
from vacpack.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    LoglikelihoodOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from vacpack.pooling_params import PoolingParams
from vacpack.runtime import LoadedModel

if TYPE_CHECKING:
    from vacpack.corpus.runner import CorpusRunner
    from vacpack.corpus.tasks import CorpusTask
    from vacpack.engine.engine import LLMEngine


class CorpusJobs:
    """LLM's corpus jobs (a base of LLM, which loads the model and builds the engine, whose
    prefix cache computes a context shared by several continuations once)."""

    loaded: LoadedModel
    config: EngineConfig
    _corpus_runner: CorpusRunner | None

    @property
    def engine(self) -> LLMEngine:
        raise NotImplementedError  # LLM's

    @property
    def corpus_runner(self) -> CorpusRunner:
        """Runs corpus jobs in packed bins; its bin budget is measured on first use."""
        if self._corpus_runner is None:
            # Imported here: generation-only use never loads the corpus machinery.
            from vacpack.corpus.runner import CorpusRunner

            self._corpus_runner = CorpusRunner(self.loaded, self.config.max_num_batched_tokens)
        return self._corpus_runner

    def embed(
        self,
        inputs: Sequence[PromptType],
        pooling: str | None = None,
        normalize: bool | None = None,
        truncate: bool = False,
        use_tqdm: bool = True,
        dimensions: int | None = None,
        prompt: str | None = None,
        prompt_name: str | None = None,
        return_failures: bool = False,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per input (text, token ids or a vLLM prompt dict), in input order
        (`out.outputs.embedding`).

        A checkpoint with sentence-transformers files pools and normalizes as they say; without
        them, as vLLM's `embed` does, decoders (generative ones too) pool their last token and
        encoders their first, normalized. `pooling` and `normalize` override that. `dimensions`
        keeps each vector's first dimensions, normalized after the cut (Matryoshka).
        `prompt` (or the checkpoint's prompt named `prompt_name`, such as "query") is put
        before each text, as sentence-transformers does. Classifiers are refused. With
        `return_failures`, an input that fails comes back as a DocumentError (index, message)
        in its place, as in every corpus job here, instead of one ValueError for the whole call.
        `truncate_prompt_tokens` (vLLM's): k keeps each input's first k tokens, its special
        tokens included ([CLS] ... [SEP]); -1 as many as the context holds (corpus/truncation.py).
        """
        from vacpack.corpus.tasks import EmbedTask, resolve_pooling, resolve_prompt

        config = resolve_pooling(self.loaded, pooling, normalize, dimensions)
        instruction = resolve_prompt(self.loaded, prompt, prompt_name)
        task = EmbedTask(self.loaded, config, truncate=truncate, prompt=instruction)
        task.keep_input_tokens(truncate_prompt_tokens)
        return self._run_corpus(task, inputs, use_tqdm, return_failures)

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        truncate: bool = False,
        use_activation: bool = True,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """One score per pair (`out.outputs.score`), as vLLM's `score`: one text_1 against every
        text_2, or text_1[i] against text_2[i].

        A cross-encoder (a *ForSequenceClassification with one label) reads each pair whole and
        scores it with the sigmoid of its logit, as sentence-transformers' CrossEncoder does
        (`use_activation=False`: the logit). Any other model embeds both texts and scores their
        cosine similarity. `truncate_prompt_tokens` k keeps a cross-encoder pair's first k
        tokens (its tokenizer cuts the longer text first, separators kept), or each embedded
        text's first k.
        """
        from vacpack.corpus.scoring import CrossEncoderTask, cosine_scores, pair_inputs

        pairs = pair_inputs(data_1, data_2)
        if hasattr(self.loaded.model, "classify"):
            task = CrossEncoderTask(self.loaded, truncate, use_activation)
            task.keep_input_tokens(truncate_prompt_tokens)
            return self._run_corpus(task, pairs, use_tqdm)
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        embedded = self.embed(
            texts,
            truncate=truncate,
            use_tqdm=use_tqdm,
            truncate_prompt_tokens=truncate_prompt_tokens,
        )
        return cosine_scores(pairs, dict(zip(texts, embedded, strict=True)))

    def loglikelihood(
        self,
        texts_or_contexts: Sequence[str],
        continuations: Sequence[str] | None = None,
        return_token_logprobs: bool = False,
        truncate: bool = False,
        use_tqdm: bool = True,
        return_failures: bool = False,
    ) -> list[LoglikelihoodOutput]:
        """Log-likelihood of each text, or of each continuation given its context.

        `llm.loglikelihood(texts)` scores whole documents (lm-evaluation-harness's
        loglikelihood_rolling); `llm.loglikelihood(contexts, continuations)` scores each
        continuation after its context and says whether it is the greedy one (its
        loglikelihood). Results carry `logprob` (the sum), `num_tokens`, `is_greedy`, and
        `token_logprobs` when asked; `return_failures` as in `embed`.
        """
        from vacpack.corpus.tasks import LoglikelihoodTask

        inputs: Sequence[Any] = texts_or_contexts
        if continuations is not None:
            if len(continuations) != len(texts_or_contexts):
                raise ValueError(
                    f"got {len(texts_or_contexts)} contexts and {len(continuations)} "
                    "continuations; give one continuation per context"
                )
            inputs = list(zip(texts_or_contexts, continuations, strict=True))
        task = LoglikelihoodTask(self.loaded, return_token_logprobs, truncate=truncate)
        if continuations is not None and self.config.enable_prefix_caching:
            # Continuations usually share contexts: the engine's prefix cache computes each once.
            from vacpack.corpus.shared_context import score_continuations

            results: list[Any] = score_continuations(self.engine, task, inputs, use_tqdm)
            return results if return_failures else _raise_failures(results)
        return self._run_corpus(task, inputs, use_tqdm, return_failures)

    def classify(
        self,
        inputs: Sequence[PromptType],
        truncate: bool = False,
        use_tqdm: bool = True,
        return_failures: bool = False,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Label probabilities per input (`out.outputs.probs`, `.label`), in input order;
        `truncate_prompt_tokens` as in `embed`."""
        from vacpack.corpus.tasks import ClassifyTask

        task = ClassifyTask(self.loaded, truncate=truncate)
        task.keep_input_tokens(truncate_prompt_tokens)
        return self._run_corpus(task, inputs, use_tqdm, return_failures)

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        pooling_task: str | None = None,
        truncate: bool = False,
        use_tqdm: bool = True,
        return_failures: bool = False,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's encode: each input's hidden states pooled for `pooling_task`, one float32 tensor
        per input (`out.outputs.data`), in input order. "token_embed": a vector per token
        [tokens, dims], normalized per token unless `pooling_params.use_activation` is False;
        "embed": the vector `embed` gives; "classify": `classify`'s label probabilities (the
        logits with use_activation False). `pooling_params.dimensions` cuts embeddings
        (Matryoshka). The other arguments as in `embed`."""
        from vacpack.corpus.encode import (
            TokenEmbedTask,
            as_pooling_output,
            check_dimensions_apply,
            check_pooling_task,
        )
        from vacpack.corpus.tasks import ClassifyTask, EmbedTask, resolve_pooling

        task_name = check_pooling_task(pooling_task)
        params = pooling_params or PoolingParams()
        check_dimensions_apply(task_name, params.dimensions)
        task: CorpusTask
        if task_name == "classify":
            task = ClassifyTask(self.loaded, truncate, params.use_activation is not False)
        else:
            normalize = params.use_activation
            if task_name == "token_embed" and normalize is None:
                normalize = True  # vLLM's default for token vectors, whatever the pooling does
            config = resolve_pooling(self.loaded, None, normalize, params.dimensions)
            kind = TokenEmbedTask if task_name == "token_embed" else EmbedTask
            task = kind(self.loaded, config, truncate=truncate)
        task.keep_input_tokens(truncate_prompt_tokens)
        results = self._run_corpus(task, as_prompt_list(prompts), use_tqdm, return_failures)
        pooled: list[Any] = [as_pooling_output(result) for result in results]
        return pooled

    def _run_corpus(
        self,
        task: CorpusTask,
        inputs: Sequence[Any],
        use_tqdm: bool,
        return_failures: bool = False,
    ) -> list[Any]:
        if isinstance(inputs, (str, Mapping)):
            inputs = [inputs]
        inputs = [corpus_input(index, item) for index, item in enumerate(inputs)]
        runner = self.corpus_runner
        results = [r for _, r in runner.run(task, inputs, len(inputs), use_tqdm)]
        return results if return_failures else _raise_failures(results)


def _raise_failures(results: list[Any]) -> list[Any]:
    """Returns the results of a corpus job, or raises one error naming every failed input."""
    from vacpack.corpus.packing import DocumentError

    failures = [r for r in results if isinstance(r, DocumentError)]
    if failures:
        details = "; ".join(f"input {f.index}: {f.message}" for f in failures[:5])
        raise ValueError(
            f"{len(failures)} of {len(results)} inputs failed ({details}); the others were "
            "computed: llm.corpus_runner.run() streams results with per-input errors"
        )
    return results
