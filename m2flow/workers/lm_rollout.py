"""LM rollout: groups of completions per prompt, streamed out as each group completes. It
follows the actor's weights as ``workers.weights.WeightReceiver``."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from typing import Any

import torch

from m2flow.engines import SamplingParams, build_engine
from m2flow.engines.batch import SequenceBatch
from m2flow.runtime import Channel, Clock, dispatch, get_tracer
from m2flow.workers.lm_common import load_model, memory_mb
from m2flow.workers.reports import GenerateReport
from m2flow.workers.weights import WeightReceiver

NO_COUNTS = {"decode_steps": 0, "graph_replays": 0}  # the engine's counts a call reports


def engine_options(rollout: dict, shared: bool) -> dict:
    """The generation backend's options from the ``rollout`` config. ``shared``: the rollout
    shares its devices with another component, so it offloads between its turns (vLLM then
    needs its sleep mode)."""
    if rollout["backend"] == "vllm":
        return {"gpu_memory_utilization": rollout["gpu_memory_utilization"], "enable_sleep_mode": shared}
    if rollout["backend"] == "torch":
        return {"max_batch_size": rollout["max_batch_size"], "cuda_graphs": rollout["cuda_graphs"],
                **{k: rollout[k] for k in ("resume", "batch_invariant") if k in rollout}}  # a multi-turn rollout's
    return {}  # build_engine names the valid backends


class LMRolloutWorker(WeightReceiver):
    def __init__(self, cfg: dict, take_turns: bool = False, offload: bool = True):
        self.cfg, r = cfg, cfg["rollout"]
        torch.manual_seed(cfg["seed"] + 7919 * (self.rank + 1))  # sampling, reproducible per rank
        # vLLM loads its own copy: the transformers model only gives it a config (and, if
        # built in memory, a checkpoint), so it need not reach the GPU.
        model, self.tokenizer = load_model(cfg, "cpu" if r["backend"] == "vllm" else self.device, r["dtype"])
        model.requires_grad_(False)
        # offload between turns only when another component uses the devices and the plan moves
        # memory out between turns (Plan.offload)
        self.shared = take_turns and offload
        self.engine = build_engine(r["backend"], model, self.tokenizer, **engine_options(r, self.shared))
        self.params = SamplingParams(n=r["n"], temperature=r["temperature"], top_p=r["top_p"], top_k=r["top_k"],
                                     max_new_tokens=r["max_new_tokens"], stop=tuple(r["stop"]))
        self.turns = self.device_turns(take_turns)
        self.version = -1  # no weights from the actor yet: generating before the first sync is an error
        self.loads: list[tuple[int, float]] = []  # (version, wall time) of the weights loaded in a generate call
        # Continuous generation (rollout.continuous): one engine call goes on across streams,
        # on devices the rollout has to itself (its KV cache stays between calls).
        self.continuous = r["continuous"] and not take_turns and getattr(self.engine, "takes_more", False)
        self.offer_lock = threading.Lock()
        self.offers: deque[tuple[int, list[dict], int, int]] = deque()  # (key, prompts, min_version, join_version)
        self.offered_up_to = 0  # the last key offered: streams come in key order, each offered once
        self.session = None  # the engine's generator, suspended between calls
        self.session_prompts: list[tuple[int, dict]] = []  # the session's prompt index -> (key, prompt)
        self.session_done = 0  # of its prompts, those whose group is out
        self.session_counted = NO_COUNTS  # its engine counts already reported by earlier calls
        self.running: int | None = None  # the key of the generate call in progress
        self.streams: dict[int, dict] = {}  # key -> its chunk pending and its report so far (groups out, counts)
        self._offload()  # until its first turn

    def _load_bucket(self, tensors: dict[str, torch.Tensor]) -> None:
        self.engine.load_weights(tensors.items())

    def pull_weights(self, actor_group: str, version: int | None = None) -> int:
        version = super().pull_weights(actor_group, version)
        self._offload()  # a load may bring weights onto the device outside the rollout's turn
        return version

    def load_weights_file(self, path: str) -> None:
        """Loads weights the actor saved (``save_weights``): a deferred evaluation's. The
        runner sends the training weights again before the rollout generates for it."""
        from safetensors.torch import load_file

        self._end_session("loading saved weights")
        self._load_bucket(load_file(path))
        self._offload()  # as after a pull: the load may bring weights onto the device

    def _loaded(self, version: int) -> None:
        self.engine.version = version  # recorded with every token sampled from now on
        self.loads.append((version, time.time()))

    def weights_hash(self) -> str:
        return self.engine.weights_hash()  # the engine's own weights (vLLM's, in its worker process)

    def _onload(self) -> None:
        if self.shared:
            with get_tracer().span("onload", cat="switch"):
                self.engine.onload()

    def _offload(self) -> None:
        if self.shared:
            with get_tracer().span("offload", cat="switch"):
                self.engine.offload()

    @dispatch(split="scatter", immediate=True)
    def offer(self, prompts: list[dict], key: int, min_version: int = 0, join_version: int | None = None) -> None:
        """The prompts of a stream launched behind the one in progress (``rollout.continuous``;
        the same arguments as its ``generate`` call, which comes later): they join the decode
        batch of an earlier stream's call as soon as slots are free and the rollout holds
        weights of at least ``join_version`` (default ``min_version``; the runner's: one
        version behind those that will train on the stream, so that joining early adds no
        staleness to what a rollout that drains between streams gives where generation bounds
        the step). Their own ``generate`` call starts them on ``min_version``'s. Answered at
        once, even while ``generate`` runs."""
        if not self.continuous:
            return
        with self.offer_lock:
            if key > self.offered_up_to:
                self.offered_up_to = key
                self.offers.append((key, list(prompts), min_version,
                                    min_version if join_version is None else max(min_version, join_version)))

    def _more(self) -> list[list[int]]:
        """The engine's ``more`` hook: the next stream offered, once its weights are in (those
        of its ``join_version`` while an earlier stream's call runs)."""
        with self.offer_lock:
            if not self.offers:
                return []
            key, prompts, min_version, join_version = self.offers[0]
            if self.version < (min_version if key == self.running else join_version):
                return []
            self.offers.popleft()
        if key != self.running:  # it starts while an earlier stream's call generates
            self.streams.setdefault(key, self._new_stream())["report"].joined_early += len(prompts)
        self.session_prompts.extend((key, p) for p in prompts)
        return [p["token_ids"] for p in prompts]

    @dispatch(split="scatter")
    def generate(self, prompts: list[dict], samples_out: Channel, granularity: int, key: int = 0,
                 weights_from: str | None = None, min_version: int = 0) -> GenerateReport:
        """Generates ``rollout.n`` completions per prompt; every ``granularity`` completed groups
        go out as one ``SequenceBatch`` (``extras``: prompt index, answers, texts, finish
        reasons, group size and the oldest policy version of its tokens; ``old_logprobs``: the
        sampling log-probs; ``versions``: each token's), put under ``key``, the stream's channel
        key. ``weights_from`` (in-flight weight updates, ``rollout.partial``): the actor group
        whose pushes are taken between decode steps, as they arrive; generation starts once
        weights of at least ``min_version`` are in (waiting for them outside the device turn),
        so no token is older than the runner allows.

        Continuous (``rollout.continuous``, with ``weights_from``): the engine's call goes on
        across streams. Once this stream's prompts have all started, those of the streams
        ``offer``ed behind it join as slots free up (each once weights of its own
        ``join_version`` are in); their groups go out under their own keys as they complete,
        and the call returns when this stream's last group is out, the others left in flight
        for their own calls."""
        clock = Clock()
        self.loads = []
        if weights_from and self.version < min_version:
            with clock.idle():
                self.pull_weights(weights_from, min_version)
        if self.version < 0:
            raise RuntimeError("the rollout has no weights: the actor must sync them first")
        between = (lambda: self.take_newer(weights_from)) if weights_from else None
        continuous = self.continuous and weights_from is not None
        if continuous:
            self.offer(prompts, key, min_version)
        stream = self.streams.setdefault(key, self._new_stream())
        self.running = key
        with clock.busy(), clock.turn(self.turns):  # busy: from the grant of the turn to its release
            self._onload()
            if continuous:
                counts = self._run_session(key, len(prompts), samples_out, granularity, between)
                if self.session_done == len(self.session_prompts):  # nothing in flight: the next starts anew
                    self._end_session("ending a call")
            else:
                for group in self.engine.generate([p["token_ids"] for p in prompts], self.params, between=between,
                                                  **self.turn_options()):
                    self._route(stream, key, (prompts[group[0].prompt_index], group), samples_out, granularity)
                counts = self._engine_counts()
            if stream["pending"]:
                self._put(stream, key, samples_out)
            samples_out.flush()
            peak = memory_mb(self.device)
            self._offload()  # context switching: the KV cache (and on a GPU the weights) make room
        del self.streams[key]
        return dataclasses.replace(stream["report"], **counts, **clock.report(lock_wait=True), peak_memory_mb=peak,
                                   weight_loads=self.loads)

    def count_group(self, report: GenerateReport, prompt: dict, completions: list) -> None:
        """Adds a group of completions, out now, to its stream's report."""
        report.groups += 1
        report.completions += len(completions)
        report.completion_tokens += sum(len(c.token_ids) for c in completions)
        report.truncated += sum(c.finish_reason == "length" for c in completions)
        report.turns += sum(c.turns for c in completions)
        report.collected += [(prompt["index"], c.sample_index) for c in completions]

    def turn_options(self) -> dict:
        """More options of the engine's generate calls: a multi-turn rollout's ``turn_ended``."""
        return {}

    @staticmethod
    def _new_stream() -> dict:
        return {"pending": [], "report": GenerateReport()}

    def _route(self, stream: dict, key: int, group: tuple[dict, list], samples_out: Channel, granularity: int) -> None:
        """Counts a completed group of stream ``key``; every ``granularity`` go out together."""
        self.count_group(stream["report"], group[0], group[1])
        stream["pending"].append(group)
        if len(stream["pending"]) == granularity:
            self._put(stream, key, samples_out)

    def _put(self, stream: dict, key: int, samples_out: Channel) -> None:
        """The groups of stream ``key`` pending go out as one batch."""
        samples_out.put(self._batch(stream["pending"]), key, weight=len(stream["pending"]))
        stream["pending"] = []

    def _engine_counts(self) -> dict[str, int]:
        """The torch engine's decode forwards (and graph replays) in its current call."""
        stats = getattr(self.engine, "stats", {})
        return {k: stats.get(k, 0) for k in NO_COUNTS}

    def _session_counts(self) -> dict[str, int]:
        """The continuous call's engine counts since an earlier call last took them."""
        now = self._engine_counts()
        taken = {k: now[k] - self.session_counted[k] for k in NO_COUNTS}
        self.session_counted = now
        return taken

    def _run_session(self, key: int, groups: int, samples_out: Channel, granularity: int, between) -> dict[str, int]:
        """Takes the engine's continuous call on until stream ``key`` has all its ``groups``
        out; the engine's decode forwards (and graph replays) meanwhile."""
        stream = self.streams[key]
        counts = dict(NO_COUNTS)
        while stream["report"].groups < groups:
            if self.session is None:  # a new engine call, numbering its prompts from 0
                self.session = self.engine.generate([], self.params, between=between, more=self._more,
                                                    **self.turn_options())
            try:
                completions = next(self.session)
            except StopIteration:  # nothing in flight and nothing offered that may start now
                counts = {k: v + self._session_counts()[k] for k, v in counts.items()}
                self._end_session("the engine's call ended")  # its prompts all done: the next numbers anew
                with self.offer_lock:
                    if not any(offered[0] == key for offered in self.offers):
                        raise RuntimeError(f"stream {key}: {stream['report'].groups} of {groups} groups out and "
                                           "none in flight or offered") from None
                continue
            k, prompt = self.session_prompts[completions[0].prompt_index]
            self.session_done += 1
            self._route(self.streams.setdefault(k, self._new_stream()), k, (prompt, completions), samples_out,
                        granularity)
        if self.session is None:  # its groups all came out in earlier calls, whose call has ended
            return counts
        return {k: v + self._session_counts()[k] for k, v in counts.items()}

    def _end_session(self, why: str) -> None:
        """Drops the continuous call, which must hold no sequence (``why``: what needs the engine)."""
        if self.session is not None and self.session_done < len(self.session_prompts):
            raise RuntimeError(f"{why} while {len(self.session_prompts) - self.session_done} prompts of streams ahead "
                               "are in flight: their generate calls must come first")
        self.session, self.session_prompts, self.session_done, self.session_counted = None, [], 0, NO_COUNTS

    def _batch(self, groups: list[tuple[dict, list]]) -> SequenceBatch:
        rows = [(prompt, c) for prompt, group in groups for c in group]
        batch = SequenceBatch.from_completions([p["token_ids"] for p, _ in rows], [c.token_ids for _, c in rows],
                                               pad_id=self.tokenizer.pad_token_id or 0)
        sampled = torch.zeros(batch.input_ids.shape)
        versions = torch.zeros(batch.input_ids.shape, dtype=torch.long)
        for i, (p, c) in enumerate(rows):
            start = len(p["token_ids"])
            sampled[i, start:start + len(c.token_ids)] = c.logprobs
            versions[i, start:start + len(c.token_ids)] = torch.tensor(c.versions or [self.version] * len(c.token_ids))
            if c.mask is not None:  # multi-turn: a tool's tokens are context, not the policy's to train on
                batch.completion_mask[i, start:start + len(c.token_ids)] = torch.tensor(c.mask, dtype=torch.long)
        batch.old_logprobs, batch.versions = sampled, versions
        batch.ids = torch.tensor([(p["index"], c.sample_index) for p, c in rows], dtype=torch.long)
        oldest = int(versions[batch.completion_mask.bool()].min()) if batch.completion_mask.any() else self.version
        batch.extras = {"prompt_index": [p["index"] for p, _ in rows], "answer": [p["answer"] for p, _ in rows],
                        "text": [self.answer_text(c) for _, c in rows],
                        "finish_reason": [c.finish_reason for _, c in rows],
                        "group_size": self.params.n, "groups": len(groups), "version": oldest}
        return batch

    def answer_text(self, c) -> str:
        """What the reward scores: the completion's text; of a multi-turn one, its last turn's."""
        return c.text if c.turns == 1 else self.tokenizer.decode(c.last_turn, skip_special_tokens=True)

    @dispatch(split="scatter", gather="concat")
    def complete(self, prompts: list[dict], temperature: float) -> list[str]:
        """One completion per prompt (evaluation), outside the training stream."""
        # A fixed seed: evaluating leaves the training stream's sampling RNG where it was.
        params = dataclasses.replace(self.params, n=1, temperature=temperature, seed=0)
        texts: dict[int, str] = {}
        self._end_session("evaluating")
        with self.turns:
            self._onload()
            for (c,) in self.engine.generate([p["token_ids"] for p in prompts], params, **self.turn_options()):
                texts[c.prompt_index] = self.answer_text(c)
            self._offload()
        return [texts[i] for i in range(len(prompts))]

    def state(self) -> dict[str, Any]:
        return {"rng": torch.get_rng_state()}

    @dispatch(split="per_rank")
    def load_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["rng"])
