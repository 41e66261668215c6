"""Multi-turn rollouts: episodes with an environment, as one :class:`~rlhf_lab.generation.rollout.Scored` batch.

Each prompt group starts from ``env.reset(task, seed)`` (one call per prompt, so the group's samples share the
prompt and a group baseline compares like with like). Then, turn by turn, every unfinished episode is continued
by the engine from its own token ids (the prompt, the sampled turns and the environment's tokens so far; never
re-rendered, see :mod:`rlhf_lab.envs.chat`) and its assistant message goes to ``env.step``; the messages that
follow are tokenised as they add to the conversation and appended as context. An episode ends when the
environment says so, at ``env.max_turns`` model turns, when its tokens reach ``env.max_tokens`` (the
trajectory's budget after the prompt) or when a turn is cut at ``trainer.max_new_tokens`` without its end
token; all but the first are marked truncated (``Scored.truncated``, read by ``algorithm.mask_truncated``).

The rollout's response part is each trajectory: ``response_mask`` is 1 on the model's tokens only (no policy
loss, KL, entropy or value loss on environment tokens; ``env.loss_on_env_tokens=true`` is the deliberate wrong
mask, for the ablation only), ``turn_rewards`` holds each turn's reward on its last model token and ``scores``
their sum (group estimators see whole trajectories; PPO's GAE runs over the model tokens). ``reset`` and
``step`` run in a pool of ``env.workers`` daemon threads, each call bounded by ``env.step_timeout`` seconds; an
environment that raises, returns the wrong types or times out is one line naming the environment, the turn and
the sample's prompt (``env.on_error=error``), or its sample leaves the batch (``drop``: scored 0, out of the
loss, counted in ``reward/dropped``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import TimeoutError as PoolTimeout
from multiprocessing.pool import ThreadPool
from typing import Any

import torch
from torch import Tensor

from rlhf_lab.data.rows import conversation_text
from rlhf_lab.envs.base import Environment, EnvState, Message, StepResult, as_step_result, check_messages
from rlhf_lab.envs.chat import ChatFormat
from rlhf_lab.envs.tools import tool_schemas
from rlhf_lab.errors import EnvError
from rlhf_lab.generation.backend import GenerationBackend, SamplingSettings
from rlhf_lab.generation.rollout import Samples, Scored
from rlhf_lab.rewards.base import first_line
from rlhf_lab.runtime import distributed

ON_ERROR = ("error", "drop")  # env.on_error


@dataclass
class Episode:
    """One sample's trajectory as it is built."""

    prompt: int  # index of its prompt (group) in the batch
    member: int  # its place in the prompt's group
    state: EnvState
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)  # everything after the prompt, as produced
    model: list[bool] = field(default_factory=list)  # which of ``ids`` the model sampled
    logprobs: list[float] = field(default_factory=list)  # the sampler's, 0 on environment tokens
    rewards: list[tuple[int, float]] = field(default_factory=list)  # (index in ids of a turn's last token, reward)
    info: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    done: bool = False
    truncated: bool = False
    error: str | None = None


def episode_seed(key: int, *parts: int | str) -> int:
    """A seed from a prompt's key and more (a sample's place, a turn): the same on every rank and in every rerun."""
    digest = hashlib.blake2b(repr((key, *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**62


class EpisodeRunner:
    """Runs a batch of episodes of ``env`` with ``engine``-sampled turns (see the module's text)."""

    def __init__(self, env: Environment, tokenizer: Any, cfg: Any) -> None:
        options = cfg.env
        self.env, self.tokenizer = env, tokenizer
        env.tokenizer = tokenizer  # type: ignore[attr-defined]  (tool calls are parsed in its format)
        self.chat = ChatFormat(tokenizer, cfg.model.chat_template, cfg.model.system_prompt,
                               described_tools(env) if env.tools else None)
        self.max_turns, self.budget = int(options.max_turns), int(options.max_tokens)
        self.timeout, self.on_error = float(options.step_timeout), options.on_error
        self.loss_on_env_tokens = bool(options.get("loss_on_env_tokens", False))
        self.seed_per_prompt = bool(cfg.trainer.seed_per_prompt)
        self.stop = tuple(options.get("stop") or ())
        self.settings: SamplingSettings | None = None  # the batch's own (:meth:`run`)
        self.openings: list[str] = []  # the last batch's opening conversation of each sample, as text
        self.workers = int(options.workers)
        self.pool = self._new_pool()
        self._longest_token: int | None = None  # characters of the vocabulary's longest token (:meth:`_too_long`)

    # ------------------------------------------------------------------------------------------------ calls

    def _new_pool(self) -> ThreadPool:
        pool = ThreadPool(self.workers)  # daemon threads: a hung tool cannot keep the process alive
        weakref.finalize(self, pool.terminate)  # closed with the runner, or at exit before the interpreter's teardown
        return pool

    def _call_all(self, calls: list[tuple[str, Callable[[], Any]]]) -> list[Any]:
        """Run the calls in the pool; each result, or the failure's one-line text (an EnvError under ``error``).
        A call that times out keeps its worker: the pool is replaced, and the calls that had not started yet go
        to the new one, so they are not timed out behind it."""
        started = [threading.Event() for _ in calls]
        pending = [self.pool.apply_async(_marking(call, flag)) for (_, call), flag in zip(calls, started, strict=True)]
        results = []
        for index, (where, _) in enumerate(calls):
            try:
                results.append(pending[index].get(timeout=self.timeout))
                continue
            except PoolTimeout:
                problem = f"timed out after env.step_timeout={self.timeout:g}s"
                stuck, self.pool = self.pool, self._new_pool()
                for later in range(index + 1, len(calls)):
                    if not started[later].is_set():
                        pending[later] = self.pool.apply_async(_marking(calls[later][1], started[later]))
                stuck.terminate()  # its queue is dropped; the hung daemon thread is left to end with the process
            except _Exited as exited:
                problem = str(exited)
            except Exception as error:  # the environment's own code failed: named, one line
                problem = f"raised {type(error).__name__}: {first_line(error)}"
            message = f"{self.env.describe()} {where} {problem}"
            if self.on_error == "error":
                raise EnvError(message)
            results.append(_Failure(message))
        return results

    # ---------------------------------------------------------------------------------------------- episodes

    def run(self, engine: GenerationBackend, settings: SamplingSettings, prompts: list[str], group_size: int,
            keys: list[int] | None, names: list[str], device: torch.device) -> tuple[Scored, list[str], Tensor]:
        """Play one episode per sample with ``settings`` (``env.stop`` for each turn where set): (the rollout with
        scores and turn rewards on ``device``, each trajectory decoded, valid [B] bool: False where the
        environment failed under ``env.on_error=drop``)."""
        # (``settings.max_prompt_tokens`` holds the episode's budget: SamplingSettings.from_config)
        self.settings = dataclasses.replace(settings, stop=self.stop or settings.stop)
        keys = keys or [episode_seed(0, i, str(p)) for i, p in enumerate(prompts)]  # (a caller without keys)
        tasks = [task_of(prompt) for prompt in prompts]
        starts = self._call_all([(f"reset of {names[i]} ({_short(prompts[i])})",
                                  _checked_reset(self.env, tasks[i], keys[i])) for i in range(len(prompts))])
        episodes = []
        for i, start in enumerate(starts):
            failed = isinstance(start, _Failure)
            messages = [{"role": "user", "content": prompts[i]}] if failed else start
            try:
                prompt_ids = self.chat.prompt_ids(messages)
            except Exception as error:  # messages the chat template cannot render: the environment's, named
                raise EnvError(f"{self.env.describe()} reset of {names[i]} ({_short(prompts[i])}) returned messages "
                               f"the chat template cannot render ({type(error).__name__}: {first_line(error)})"
                               ) from None
            for member in range(group_size):
                state = EnvState(dict(tasks[i]), keys[i], messages=[dict(m) for m in messages])
                episodes.append(Episode(i, member, state, prompt_ids, error=start.text if failed else None))
        self.openings = [conversation_text(e.state.messages) for e in episodes]
        turn = 0
        while True:
            active = [e for e in episodes if not e.done]
            if not distributed.maximum(torch.tensor(float(len(active)))):
                break
            if turn == 0:
                seeds = keys if self.seed_per_prompt else None
                settings = self.settings
                rows = engine.generate([episodes[i * group_size].prompt_ids for i in range(len(prompts))],
                                       group_size, seeds=seeds, settings=settings)
            else:
                settings, rows = self._continue(engine, active or episodes[:1], keys, turn)
                if not active:  # this rank's episodes are over: it samples along (FSDP's forwards are collective)
                    continue
            self._take_turn(active, rows, settings.max_new_tokens, names, prompts)
            turn += 1
        return self._rollout(episodes, group_size, device)

    def _continue(self, engine: GenerationBackend, active: list[Episode], keys: list[int], turn: int
                  ) -> tuple[SamplingSettings, Samples]:
        """Sample the next turn of every unfinished episode from its own token ids: (the settings, the samples)."""
        longest_left = max(self.budget - len(e.ids) for e in active)
        settings = dataclasses.replace(self.settings, max_new_tokens=max(1, min(self.settings.max_new_tokens,
                                                                                 longest_left)))
        # seeded by the prompt's key and the sample's place in its group: the same tokens on any number of ranks
        seeds = [episode_seed(keys[e.prompt], e.member, turn) for e in active] if self.seed_per_prompt else None
        return settings, engine.generate([e.prompt_ids + e.ids for e in active], 1, seeds=seeds, settings=settings)

    def _take_turn(self, active: list[Episode], rows: Samples, limit: int, names: list[str],
                   prompts: list[str]) -> None:
        """Append each episode's sampled turn, step the environment, and append what it answers."""
        response_ids, mask = rows.response_ids.tolist(), rows.response_mask.tolist()
        logprobs = rows.logprobs.tolist()
        stepping = []
        for row, episode in enumerate(active):  # turn 0: every episode, prompt-major as the engine's rows
            length = int(sum(mask[row]))
            ids, lps = response_ids[row][:length], logprobs[row][:length]
            cut = self._cut(ids, limit)
            room = self.budget - len(episode.ids)
            if len(ids) > room:
                ids, lps, cut = ids[:room], lps[:room], True
            episode.ids += ids
            episode.model += [True] * len(ids)
            episode.logprobs += lps
            episode.state.turn += 1
            text = self.chat.assistant_text(ids)
            episode.state.messages.append({"role": "assistant", "content": text})
            episode.truncated = cut
            if episode.error is not None:
                episode.done = True
                continue
            where = f"turn {episode.state.turn} of {names[episode.prompt]} ({_short(prompts[episode.prompt])})"
            stepping.append((episode, where, _checked_step(self.env, text, episode.state)))
        results = self._call_all([(where, call) for _, where, call in stepping])
        for (episode, where, _), result in zip(stepping, results, strict=True):
            if isinstance(result, _Failure):
                episode.error, episode.done = result.text, True
                continue
            self._after_step(episode, result, where)

    def _after_step(self, episode: Episode, result: StepResult, where: str) -> None:
        episode.rewards.append((len(episode.ids) - 1, result.reward))
        for key, value in result.info.items():
            episode.info[key] += float(value)
        if result.done or not result.messages or episode.truncated:
            episode.done = True
            episode.truncated = episode.truncated or not result.done
            return
        if episode.state.turn >= self.max_turns:
            episode.done = episode.truncated = True
            return
        if self._too_long(result.messages, self.budget - len(episode.ids)):  # cut before tokenising, not after
            episode.done = episode.truncated = True
            return
        try:
            added = self.chat.continuation_ids(result.messages)
        except ValueError as error:
            raise EnvError(f"{self.env.describe()} {where}: {error}") from None
        except Exception as error:  # messages the chat template cannot render
            raise EnvError(f"{self.env.describe()} {where} returned messages the chat template cannot render "
                           f"({type(error).__name__}: {first_line(error)})") from None
        if len(episode.ids) + len(added) >= self.budget:  # no room left for another model token
            episode.done = episode.truncated = True
            return
        episode.ids += added
        episode.model += [False] * len(added)
        episode.logprobs += [0.0] * len(added)
        episode.state.messages.extend(result.messages)

    def _too_long(self, messages: list[Message], room: int) -> bool:
        """Whether ``messages`` cannot fit in ``room`` tokens, told from their length in characters: no token
        decodes to more characters than the vocabulary's longest, so a text longer than ``room`` times that is more
        than ``room`` tokens (a 20 MB reply is not tokenised to learn it)."""
        if self._longest_token is None:
            self._longest_token = max((len(token) for token in self.tokenizer.get_vocab()), default=1)
        return sum(len(message["content"]) for message in messages) > room * max(self._longest_token, 1)

    def _cut(self, ids: list[int], limit: int) -> bool:
        """Whether a turn was cut at the call's token ``limit`` before its end (an EOS; the engine stops earlier at
        a stop string). A tokenizer without EOS (the exact task) has turns of fixed length: never cut."""
        eos = self.tokenizer.eos_token_id
        return eos is not None and len(ids) >= limit and ids[-1] != eos

    # ----------------------------------------------------------------------------------------------- rollout

    def _rollout(self, episodes: list[Episode], group_size: int, device: torch.device
                 ) -> tuple[Scored, list[str], Tensor]:
        pad = self.tokenizer.pad_token_id
        prompt_width = max(len(e.prompt_ids) for e in episodes)
        width = max(1, max(len(e.ids) for e in episodes))
        batch = len(episodes)
        input_ids = torch.full((batch, prompt_width + width), pad, dtype=torch.long)
        attention = torch.zeros(batch, prompt_width + width, dtype=torch.long)
        loss_mask, logprobs, turn_rewards = (torch.zeros(batch, width) for _ in range(3))
        for row, e in enumerate(episodes):
            p, n = len(e.prompt_ids), len(e.ids)
            input_ids[row, prompt_width - p : prompt_width] = torch.tensor(e.prompt_ids)
            input_ids[row, prompt_width : prompt_width + n] = torch.tensor(e.ids, dtype=torch.long)
            attention[row, prompt_width - p : prompt_width + n] = 1
            loss_mask[row, :n] = 1.0 if self.loss_on_env_tokens else torch.tensor(e.model, dtype=torch.float32)
            logprobs[row, :n] = torch.tensor(e.logprobs)
            for position, reward in e.rewards:
                turn_rewards[row, position] += reward
        valid = torch.tensor([e.error is None for e in episodes])
        turn_rewards = turn_rewards * valid[:, None]
        keys = sorted({key for e in episodes for key in e.info})
        extras = {
            "env/turns_mean": torch.tensor([float(e.state.turn) for e in episodes]),
            "env/truncated_frac": torch.tensor([float(e.truncated) for e in episodes]),
            **{f"env/{key}": torch.tensor([e.info.get(key, 0.0) for e in episodes]) for key in keys},
        }
        samples = Samples(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                          response_mask=loss_mask.to(device), prompt_width=prompt_width, group_size=group_size,
                          logprobs=(logprobs * loss_mask).to(device), entropy=torch.zeros_like(logprobs).to(device))
        # The environment scores its own episodes: the rollout carries their rewards from the start.
        rollout = Scored.from_samples(samples, scores=turn_rewards.sum(-1).to(device),
                                      turn_rewards=turn_rewards.to(device),
                                      truncated=torch.tensor([e.truncated for e in episodes]).to(device),
                                      extras={key: value.to(device) for key, value in extras.items()})
        if not any(e.error is None for e in episodes):  # env.on_error=drop would train on nothing
            raise EnvError(f"every one of the {len(episodes)} samples failed ({episodes[0].error}); env.on_error=drop "
                           "would train on nothing")
        texts = [self.tokenizer.decode(e.ids) for e in episodes]
        for e in episodes:
            if e.error is not None:
                warnings.warn(f"{e.error} (env.on_error=drop: the sample is left out)", stacklevel=2)
        return rollout, texts, valid


@dataclass
class _Failure:
    text: str


class _Exited(Exception):
    """An environment's call that ended its thread with ``sys.exit`` (caught, so it is named as such)."""


def _marking(call: Callable[[], Any], started: threading.Event) -> Callable[[], Any]:
    """``call``, setting ``started`` when a worker takes it; ``sys.exit`` inside it becomes :class:`_Exited`."""
    def run() -> Any:
        started.set()
        try:
            return call()
        except SystemExit as exit_:
            raise _Exited(f"called sys.exit({exit_.code!r})") from None
    return run


def described_tools(env: Environment) -> list[dict[str, Any]]:
    """The JSON schemas of ``env.tools``; a tool transformers cannot describe is one line naming it."""
    try:
        return tool_schemas(env.tools)
    except Exception as error:  # transformers' DocstringParsingException, TypeHintParsingException
        names = ", ".join(getattr(tool, "__name__", repr(tool)) for tool in env.tools)
        raise EnvError(f"{env.describe()}: a tool of {names} cannot be described to the model ({first_line(error)}); "
                       "give each a type hint per argument and a Google-style docstring with an Args: section"
                       ) from None


def task_of(prompt: str) -> dict[str, Any]:
    """The task an episode starts from: the prompt's text, its messages (a conversational prompt) and its row's other
    columns (:mod:`rlhf_lab.data.rows`)."""
    messages = getattr(prompt, "messages", None)
    return {**getattr(prompt, "columns", {}), "prompt": str(prompt),
            **({"messages": [dict(m) for m in messages]} if messages else {})}


def _checked_reset(env: Environment, task: dict[str, Any], seed: int) -> Callable[[], list[Message]]:
    def call() -> list[Message]:
        messages = env.reset(dict(task), seed)
        check_messages(messages, "reset")
        if not messages:
            raise ValueError("reset returned no messages")
        return messages
    return call


def _checked_step(env: Environment, text: str, state: EnvState) -> Callable[[], StepResult]:
    return lambda: as_step_result(env.step(text, state))


def _short(prompt: str) -> str:
    return repr(prompt if len(prompt) <= 60 else prompt[:57] + "...")
