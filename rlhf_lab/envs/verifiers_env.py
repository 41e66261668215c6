"""``env=verifiers env.id=NAME``: a ``verifiers`` environment's own rollouts, trained on the exact sampled token ids.

A ``verifiers`` environment (its dataset, its rollout loop, its rubric) talks to its model through an OpenAI client.
The trainer serves the policy to it in-process (:mod:`rlhf_lab.envs.verifiers_server`: the OpenAI routes of
``rlhf-lab serve`` on a loopback port, over the rollout worker, so every step's requests are answered with that
step's weights) and runs the environment's ``rollout`` for each sample, then its rubric's ``score_group`` per
prompt group, through ``verifiers``' chat-completions client, which keeps each response's ``prompt_token_ids``,
sampled ``token_ids`` and log-probs when the request asks for them (``return_token_ids``, ``logprobs``).

Each trajectory becomes the trainer's sample exactly as the server sampled it, never re-tokenised: the first turn's
prompt ids are the sample's prompt, each turn's sampled ids are model tokens (their sampler log-probs kept), and in
a multi-turn environment the tokens a later turn's prompt adds after the conversation so far are environment tokens
(out of the loss). A later prompt that does not extend the earlier tokens (a chat template that re-renders past
turns) is an error naming the turn, since no single token sequence holds that trajectory. The rubric's reward is
the sample's score, placed on its last token; the rubric's metrics are logged as ``env/<name>``.

Tasks come from the environment's own dataset (``get_dataset()``); the run's data only counts and seeds the
prompts: prompt ``i`` of a step plays row ``key mod len(dataset)`` (its per-prompt key), so a rerun plays the same.

``env.id`` names an installed ``verifiers`` environment (``verifiers.load_environment(env.id, **env.args)``), a
``module:attribute`` (an environment object, or a function returning one called with ``env.args``), or a name
given to :func:`provide` in this process (the Python API: an environment object built in a notebook). Needs
``verifiers`` 0.3.1 (``make install-verifiers``: a venv of its own, see docs/guides/environments.md).
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import importlib.util
import logging
from typing import Any

import torch
from torch import Tensor

from rlhf_lab.data.rows import conversation_text
from rlhf_lab.envs.base import Environment, EnvState, StepResult
from rlhf_lab.envs.episodes import Episode, EpisodeRunner, episode_seed
from rlhf_lab.errors import EnvError
from rlhf_lab.generation.backend import GenerationBackend, SamplingSettings
from rlhf_lab.generation.rollout import Scored
from rlhf_lab.registry import register
from rlhf_lab.rewards.base import first_line
from rlhf_lab.runtime import distributed

VERSION = "0.3.1"  # the verifiers release with the in-process rollout API (requirements-verifiers.txt)
INSTALL = "make install-verifiers"
environments: dict[str, Any] = {}  # environment objects given in this process (:func:`provide`)


def provide(name: str, environment: Any) -> str:
    """Make ``environment`` (a ``verifiers`` environment object) the one ``env.id=name`` runs in this process."""
    environments[name] = environment
    return name


def not_installed(reason: str) -> EnvError:
    return EnvError(f"env=verifiers needs the verifiers package ({VERSION}), which cannot be imported here "
                    f"({reason}); install it with `{INSTALL}` (a venv of its own, see docs/guides/environments.md)")


def no_id() -> EnvError:
    return EnvError("env=verifiers needs env.id=NAME: an installed verifiers environment, module:attribute, or a "
                    "name given to rlhf_lab.envs.verifiers_env.provide")


def import_verifiers() -> Any:
    """``verifiers.legacy`` (the in-process API), or one line saying how to install it."""
    try:
        import verifiers.legacy as vf
    except ImportError as error:
        raise not_installed(first_line(error)) from None
    return vf


def check_findable(env_id: Any) -> None:
    """At compose time, before any model loads and without importing the environment: the verifiers package is
    installed and ``env.id`` names a module there is (a provided name, ``module:attribute``'s module, or an
    environment's package); one line where not, as :func:`load_environment` would say minutes later."""
    if not _findable("verifiers.legacy"):  # the in-process API (its package is imported to look)
        raise not_installed("No module named 'verifiers.legacy'")
    if not isinstance(env_id, str) or not env_id:
        raise no_id()
    if env_id in environments:
        return
    if ":" in env_id:
        module = env_id.partition(":")[0]
        if not _findable(module):
            raise EnvError(f"env.id={env_id!r} cannot be imported (No module named {module!r}); give module:attribute "
                           "of a verifiers environment or of a function returning one")
        return
    module = env_id.replace("-", "_").split("/")[-1]  # the module verifiers' load_environment imports
    if not _findable(module):
        raise EnvError(f"env.id={env_id!r} is not an installed verifiers environment (No module named {module!r}); "
                       f"install it into the verifiers venv (`{INSTALL}`, then `pip install` the environment's "
                       "package), or give module:attribute")


def _findable(module: str) -> bool:
    """Whether ``module`` can be imported here (its parent packages are imported to look; nothing else runs)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError, AttributeError):
        return False


def load_environment(env_id: Any, args: dict[str, Any]) -> Any:
    """The ``verifiers`` environment ``env.id`` names (see the module's text); one line where none is found."""
    vf = import_verifiers()
    if not isinstance(env_id, str) or not env_id:
        raise no_id()
    if env_id in environments:
        environment = environments[env_id]
    elif ":" in env_id:
        module_name, _, attribute = env_id.partition(":")
        try:
            environment = importlib.import_module(module_name)
            for part in attribute.split("."):
                environment = getattr(environment, part)
        except (ImportError, AttributeError) as error:
            raise EnvError(f"env.id={env_id!r} cannot be imported ({first_line(error)}); give module:attribute of "
                           "a verifiers environment or of a function returning one") from None
        if not isinstance(environment, vf.Environment) and callable(environment):
            environment = _built(lambda: environment(**args), env_id)
    else:
        logger = logging.getLogger("verifiers.legacy.utils.env_utils")  # it logs the failure too: said once, below
        level = logger.level
        logger.setLevel(logging.CRITICAL)
        try:
            environment = _built(lambda: vf.load_environment(env_id, **args), env_id, (ImportError, ValueError))
        except (ImportError, ValueError) as error:  # verifiers says "Could not import 'NAME' environment" (ValueError)
            raise EnvError(f"env.id={env_id!r} is not an installed verifiers environment ({first_line(error)}); "
                           f"install it into the verifiers venv (`{INSTALL}`, then `pip install` the environment's "
                           "package), or give module:attribute") from None
        finally:
            logger.setLevel(level)
    if not isinstance(environment, vf.Environment):
        raise EnvError(f"env.id={env_id!r} gave {type(environment).__name__}, not a verifiers Environment "
                       f"(verifiers {VERSION}: SingleTurnEnv, MultiTurnEnv, ToolEnv, ...)")
    return environment


def _built(build: Any, env_id: str, passed: tuple[type[BaseException], ...] = ()) -> Any:
    """The environment a factory (``module:function``, or a verifiers package's ``load_environment``) returns; one line
    naming ``env.id`` where it raises or exits instead (``passed``: errors the caller words itself)."""
    try:
        return build()
    except passed:
        raise
    except SystemExit as exit_:  # an exit inside the factory would end the run with nothing said
        raise EnvError(f"env.id={env_id!r}: its environment factory exited (sys.exit({exit_.code!r})) instead of "
                       "returning an environment; nothing was trained") from None
    except Exception as error:  # the factory's own failure, whatever it is
        raise EnvError(f"env.id={env_id!r}: its environment factory raised {type(error).__name__}: "
                       f"{first_line(error)}") from None


@register("env", "verifiers")
class VerifiersEnvironment(Environment):
    """A ``verifiers`` environment (``env.id``), played by :class:`VerifiersRunner` instead of reset/step."""

    name = "verifiers"

    @staticmethod
    def check_config(cfg: Any) -> None:
        """Compose time (rlhf_lab/config/validate_env.py): :func:`check_findable`."""
        check_findable(cfg.get("id"))

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.env_id = self.option("id")
        args = self.option("args", {})
        self.environment = load_environment(self.env_id, dict(args.items()) if hasattr(args, "items") else {})

    def make_runner(self, tokenizer: Any, cfg: Any) -> VerifiersRunner:
        """What the trainer runs this environment's batches with (instead of the reset/step runner)."""
        return VerifiersRunner(self, tokenizer, cfg)

    def reset(self, task: dict[str, Any], seed: int) -> list[dict[str, Any]]:
        raise EnvError("env=verifiers plays its environment's own rollouts (VerifiersRunner), not reset/step")

    def step(self, assistant_message: str, state: EnvState) -> StepResult:
        raise EnvError("env=verifiers plays its environment's own rollouts (VerifiersRunner), not reset/step")

    def describe(self) -> str:
        return f"env=verifiers env.id={self.env_id}"


class VerifiersRunner(EpisodeRunner):
    """Plays a batch of a ``verifiers`` environment's rollouts against the served policy (see the module's text);
    the rollout it returns is built as the reset/step runner's is (:meth:`EpisodeRunner._rollout`)."""

    def __init__(self, env: VerifiersEnvironment, tokenizer: Any, cfg: Any) -> None:
        if distributed.world_size() > 1:  # each rank would serve and play its own; not built yet
            raise EnvError(f"{env.describe()} runs in one process; run it without torchrun (world size "
                           f"{distributed.world_size()})")
        super().__init__(env, tokenizer, cfg)
        self.environment = env.environment
        self.dataset = self.environment.get_dataset()
        if self.dataset is None or len(self.dataset) == 0:
            raise EnvError(f"{env.describe()} has no dataset to draw its tasks from")
        self.max_model_len = int(cfg.data.max_prompt_tokens) + self.budget
        self.server: Any = None  # started at the first batch (:class:`~.verifiers_server.PolicyServer`)
        for name in ("httpx", "httpx2", "openai"):  # a log line per request to the served policy otherwise
            logging.getLogger(name).setLevel(logging.WARNING)

    def run(self, engine: GenerationBackend, settings: SamplingSettings, prompts: list[str], group_size: int,
            keys: list[int] | None, names: list[str], device: torch.device) -> tuple[Scored, list[str], Tensor]:
        """Play ``group_size`` rollouts of one dataset row per prompt, sampled by ``engine`` (the awake worker)."""
        from rlhf_lab.envs.verifiers_server import PolicyServer

        if self.server is None:
            self.server = PolicyServer(self.tokenizer, self.max_model_len)
        keys = keys or [episode_seed(0, i, str(p)) for i, p in enumerate(prompts)]
        inputs = [self._task(key) for key in keys]
        extra_body: dict[str, Any] = {"return_token_ids": True}
        if settings.top_k:
            extra_body["top_k"] = settings.top_k
        sampling_args = {"max_tokens": settings.max_new_tokens, "temperature": settings.temperature,
                         "top_p": settings.top_p, "logprobs": True, "extra_body": extra_body}
        if self.stop or settings.stop:
            sampling_args["stop"] = list(self.stop or settings.stop)
        with self.server.serving(engine):
            states = asyncio.run(self._play(inputs, group_size, sampling_args))
        episodes = []
        for index, state in enumerate(states):
            prompt = index // group_size
            episodes.append(self._episode(state, prompt, index % group_size, keys[prompt], inputs[prompt],
                                          f"{names[prompt]} (row {inputs[prompt]['example_id']})"))
        self.openings = [conversation_text(e.state.messages) for e in episodes]
        return self._rollout(episodes, group_size, device)

    def _task(self, key: int) -> dict[str, Any]:
        row = dict(self.dataset[key % len(self.dataset)])
        row.setdefault("example_id", key % len(self.dataset))
        return row

    async def _play(self, inputs: list[dict[str, Any]], group_size: int, sampling_args: dict[str, Any]
                    ) -> list[Any]:
        """Every prompt's group of rollouts, each group scored together by the rubric (prompt-major)."""
        from openai import AsyncOpenAI
        from verifiers.legacy.clients import OpenAIChatCompletionsClient

        from rlhf_lab.envs.verifiers_server import SERVED_NAME

        openai = AsyncOpenAI(base_url=self.server.base_url, api_key=self.server.token, max_retries=2,
                             timeout=self.timeout)
        client = OpenAIChatCompletionsClient(openai)
        rubric = self.environment.rubric

        in_flight = asyncio.Semaphore(self.workers)  # env.workers rollouts at a time (the server samples one by one)

        async def one(task: dict[str, Any]) -> Any:
            async with in_flight:
                try:
                    return await self.environment.rollout(copy.deepcopy(task), client, SERVED_NAME,
                                                          dict(sampling_args))
                except Exception as error:  # the environment's own code failed: named by :meth:`_episode`
                    return _Failed(error=error)

        async def group(task: dict[str, Any]) -> list[Any]:
            states = list(await asyncio.gather(*(one(task) for _ in range(group_size))))
            played = [state for state in states if not isinstance(state, _Failed)]
            if played:
                await rubric.score_group(played)
            for state in played:
                await rubric.cleanup(state)
            return states

        try:
            groups = await asyncio.gather(*(group(task) for task in inputs))
        finally:
            await openai.close()
        return [state for states in groups for state in states]

    def _episode(self, state: Any, prompt: int, member: int, key: int, task: dict[str, Any], where: str
                 ) -> Episode:
        """One rollout's trajectory as the trainer's sample: the server's ids and log-probs, the rubric's reward."""
        messages = [dict(m) for m in task.get("prompt") or []]
        steps = list(state.get("trajectory") or [])
        env_state = EnvState({k: v for k, v in task.items() if k != "prompt"}, key, len(steps), messages)
        error = state.get("error")
        problem = f"raised {_causes(error)}" if error is not None else None
        if problem is None and (not steps or any(step.get("tokens") is None for step in steps)):
            problem = "returned a turn without token ids (the client kept none)"
        if problem is not None:
            message = f"{self.env.describe()} rollout of {where} {problem}"
            if self.on_error == "error":
                raise EnvError(message)
            return Episode(prompt, member, env_state, [self.tokenizer.eos_token_id or 0], [0], [False], [0.0],
                           error=message, done=True)
        episode = Episode(prompt, member, env_state, list(steps[0]["tokens"]["prompt_ids"]), done=True)
        for turn, step in enumerate(steps, start=1):
            tokens = step["tokens"]
            context = episode.prompt_ids + episode.ids
            if turn > 1:
                prompt_ids = list(tokens["prompt_ids"])
                if prompt_ids[:len(context)] != context:
                    raise EnvError(f"{self.env.describe()} turn {turn} of {where}: its prompt's token ids do not "
                                   "extend the conversation's so far (the chat template re-renders earlier turns); "
                                   "no single token sequence holds this trajectory")
                added = prompt_ids[len(context):]
                episode.ids += added
                episode.model += [False] * len(added)
                episode.logprobs += [0.0] * len(added)
            episode.ids += list(tokens["completion_ids"])
            episode.model += [True] * len(tokens["completion_ids"])
            episode.logprobs += [float(x) for x in tokens["completion_logprobs"]]
        episode.truncated = bool(state.get("is_truncated")) or len(episode.ids) > self.budget
        if len(episode.ids) > self.budget:  # env.max_tokens: the trajectory's budget after the prompt
            del episode.ids[self.budget:], episode.model[self.budget:], episode.logprobs[self.budget:]
        episode.rewards.append((max(len(episode.ids) - 1, 0), float(state.get("reward") or 0.0)))
        for name, value in (state.get("metrics") or {}).items():
            if isinstance(value, int | float):
                episode.info[name] += float(value)
        return episode


class _Failed(dict):
    """A rollout whose environment raised: its error, no trajectory."""


def _causes(error: BaseException) -> str:
    """An error and its causes on one line (verifiers wraps a client's failure in its own ``ModelError``)."""
    parts = []
    while error is not None and len(parts) < 6:
        text = first_line(error)
        parts.append(f"{type(error).__name__}: {text}" if text and text != type(error).__name__ else type(error).__name__)
        error = error.__cause__ or error.__context__
    return " <- ".join(parts)
