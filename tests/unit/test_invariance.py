"""The invariance of the update: one mini-batch's loss and gradient do not depend on how it is cut.

For every loss aggregation (``token_mean``, ``sequence_mean``, ``sequence_sum_constant``) and PPO's value loss
(shared value head and separate critic), the loss and the gradient of one update (fp32, a tiny Llama, ragged
prompts and responses) are the same whether the mini-batch runs whole, in micro-batches of 1 or 3 rows, by a
token budget, packed padding-free or padded, through the LM head in chunks, and on one process or two (gloo,
DDP). Run as a script (``python tests/unit/test_invariance.py``) it prints the largest relative difference per
aggregation.
"""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # conftest's compose, run as a script too
from conftest import compose, tiny_overrides  # noqa: E402

import rlhf_lab.components  # noqa: E402, F401
from rlhf_lab.generation.rollout import Rollout  # noqa: E402
from rlhf_lab.models import loading as models  # noqa: E402
from rlhf_lab.registry import get  # noqa: E402
from rlhf_lab.runtime.timer import StepTimer  # noqa: E402
from rlhf_lab.step.update import Updater  # noqa: E402

PROMPT, RESPONSE, ROWS = 5, 6, 6
CASES = {  # name -> overrides of the algorithm
    "token_mean": ["algorithm=grpo", "algorithm.loss_aggregation=token_mean"],
    "sequence_mean": ["algorithm=grpo", "algorithm.loss_aggregation=sequence_mean"],
    "sequence_sum_constant": ["algorithm=grpo", "algorithm.loss_aggregation=sequence_sum_constant"],
    "ppo_value_shared": ["algorithm=ppo", "algorithm.critic=shared", "algorithm.vf_coef=1.0", "algorithm.mini_batch_size=0"],
    "ppo_value_separate": ["algorithm=ppo", "algorithm.critic=separate", "algorithm.vf_coef=1.0",
                           "algorithm.mini_batch_size=0"],
}
SPLITS = {  # name -> trainer overrides (the first is the reference)
    "whole": {},
    "rows_1": {"micro_batch_size": 1},
    "rows_3": {"micro_batch_size": 3},
    "budget_padded": {"max_tokens_per_micro_batch": 24, "pack_rows": False},
    "budget_packed": {"max_tokens_per_micro_batch": 24, "pack_rows": True},
    "whole_packed": {"pack_rows": True},
    "head_chunks": {"chunked_logprobs": True, "lm_head_chunk": 4},
}


def batch(vocab: int) -> dict[str, torch.Tensor]:
    """Six rows: prompts of 5, 3, 4, 5, 2, 5 tokens (left padded), responses of 6, 2, 4, 1, 5, 3 tokens."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, vocab, (ROWS, PROMPT + RESPONSE), generator=generator)
    mask = torch.ones(ROWS, PROMPT + RESPONSE, dtype=torch.long)
    for row, (prompt, response) in enumerate(zip([5, 3, 4, 5, 2, 5], [6, 2, 4, 1, 5, 3], strict=True)):
        mask[row, : PROMPT - prompt] = 0
        mask[row, PROMPT + response:] = 0
    input_ids = torch.where(mask > 0, input_ids, 2)
    response_mask = mask[:, PROMPT:].float()
    values = torch.randn(ROWS, RESPONSE, generator=generator) * 0.1
    return {"input_ids": input_ids, "attention_mask": mask, "response_mask": response_mask,
            "advantages": torch.randn(ROWS, RESPONSE, generator=generator) * response_mask,
            "logprob_noise": torch.randn(ROWS, RESPONSE, generator=generator) * 0.1,
            "values": values * response_mask, "returns": (values + 0.3) * response_mask}


@functools.cache
def case_config(case: str) -> DictConfig:
    return compose(tiny_overrides(None) + CASES[case] + [f"trainer.max_new_tokens={RESPONSE}",
                                                         "trainer.prompts_per_step=2", "algorithm.group_size=3",
                                                         "trainer.max_grad_norm=null"])


@functools.cache
def tokenizer_of(case: str):
    return models.load_tokenizer(case_config(case).model)


def one_update(case: str, split: str, rows: slice = slice(None), dtype: torch.dtype = torch.float32) -> dict:
    """The loss and gradient of one mini-batch update of ``rows`` of :func:`batch` (under DDP when a process group
    is up), with the optimizer step replaced by reading the gradients."""
    cfg = copy.deepcopy(case_config(case))
    cfg.trainer.update(SPLITS[split] if split in SPLITS else RANK_CUTS[split])
    tokenizer = tokenizer_of(case)
    policy = models.build_tiny_llama(tokenizer, cfg.model.tiny, seed=0).to(dtype)
    algorithm = get("algorithm", cfg.algorithm.name)(cfg.algorithm)
    algorithm.setup(policy)
    for module in algorithm.modules().values():
        module.to(dtype)
    if getattr(algorithm, "critic", None) is not None:  # a value head that starts at zero learns nothing yet
        torch.manual_seed(1)
        for parameter in algorithm.critic.parameters():
            if parameter.requires_grad:
                parameter.data.normal_(0, 0.05)
    named = dict(policy.named_parameters()) | {f"critic.{n}": p for module in algorithm.modules().values()
                                               for n, p in module.named_parameters()}
    sync = [policy]
    if dist.is_initialized():
        policy = torch.nn.parallel.DistributedDataParallel(policy)
        sync = [policy]

        def wrap(module):
            sync.append(torch.nn.parallel.DistributedDataParallel(module))
            return sync[-1]

        algorithm.wrap_modules(wrap)
    data = {key: value[rows] for key, value in batch(len(tokenizer)).items()}
    updater = Updater(cfg, policy, algorithm, None, torch.device("cpu"), sync_modules=sync)
    with torch.no_grad():  # π_old: this policy's log-probs, moved a little (ratios off 1, some clipped)
        logprobs = updater.forward(Rollout(data["input_ids"], data["attention_mask"], data["response_mask"], PROMPT,
                                           1, torch.zeros(1), torch.zeros(1))).logprobs
    rollout = Rollout(data["input_ids"], data["attention_mask"], data["response_mask"], PROMPT, 1,
                      logprobs=(logprobs + data["logprob_noise"]) * data["response_mask"],
                      entropy=torch.zeros_like(logprobs), advantages=data["advantages"], values=data["values"],
                      returns=data["returns"])
    gradients = {}

    def read_gradients(loss_finite: bool = True) -> bool:
        gradients.update({name: p.grad.double().clone() for name, p in named.items() if p.grad is not None})
        return True

    updater.optimizer_step = read_gradients
    stats = updater.minibatch_update(rollout, 0.0, StepTimer())
    return {"loss": stats["loss/total"], "value_loss": stats.get("loss/value"),
            "gradients": gradients}


def relative_differences(result: dict, reference: dict) -> dict[str, float]:
    """``gradient``: ‖Δg‖ / ‖g‖ over every trainable tensor as one vector; ``loss``: the largest of |Δloss| / |loss|
    for the total loss and the value loss."""
    names = sorted(reference["gradients"])
    assert sorted(result["gradients"]) == names
    flat = torch.cat([result["gradients"][n].flatten() for n in names])
    expected = torch.cat([reference["gradients"][n].flatten() for n in names])
    losses = [abs(result["loss"] - reference["loss"]) / abs(reference["loss"])]
    if reference["value_loss"] is not None:
        losses.append(abs(result["value_loss"] - reference["value_loss"]) / abs(reference["value_loss"]))
    return {"gradient": float((flat - expected).norm() / expected.norm()), "loss": max(losses)}


# On two ranks (each its half of the rows): one micro-batch each, as many each (1 row), and unequal counts (a
# 21-token budget cuts rank 0's rows of 11, 5 and 8 tokens in two and keeps rank 1's 6, 7 and 8 in one).
RANK_CUTS = {"budget_packed_21": {"max_tokens_per_micro_batch": 21, "pack_rows": True}}
TWO_RANK_SPLITS = ("whole", "budget_packed", "rows_1", "budget_packed_21")


def _rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        half = ROWS // 2
        results = {f"{case}/{split}": one_update(case, split, slice(rank * half, (rank + 1) * half))
                   for case in CASES for split in TWO_RANK_SPLITS}
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def two_ranks(tmp: Path) -> dict:
    out = tmp / "two_ranks.pt"
    mp.spawn(_rank, args=(str(tmp / "store"), str(out)), nprocs=2, join=True)
    return torch.load(out, weights_only=True)


def differences(tmp: Path | None, dtype: torch.dtype = torch.float32,
                splits: tuple[str, ...] = tuple(SPLITS)) -> dict[str, dict[str, dict[str, float]]]:
    """Per case, the relative differences of every split (and, with ``tmp``, of two ranks) from the whole
    mini-batch's update."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    distributed = two_ranks(tmp) if tmp is not None else {}
    for case in CASES:
        reference = one_update(case, "whole", dtype=dtype)
        table[case] = {split: relative_differences(one_update(case, split, dtype=dtype), reference)
                       for split in splits if split != "whole"}
        for key, result in distributed.items():
            if key.startswith(f"{case}/"):
                table[case][f"two_ranks_{key.split('/')[1]}"] = relative_differences(result, reference)
    return table


def test_one_update_does_not_depend_on_how_the_mini_batch_is_cut(tmp_path) -> None:
    """fp32: the gradient to 1e-6 (relative norm); the loss to fp32's resolution of log-probs near −11 (~1e-6
    absolute) under the cancellation of signed advantages."""
    for case, row in differences(tmp_path).items():
        for split, difference in row.items():
            assert difference["gradient"] <= 1e-6, (case, split, difference)
            assert difference["loss"] <= 1e-5, (case, split, difference)


def test_in_float64_the_cuts_agree_to_rounding() -> None:
    """The same property with float64 weights: what is left of the fp32 differences is rounding."""
    for case, row in differences(None, torch.float64).items():
        for split, difference in row.items():
            assert max(difference.values()) <= 1e-12, (case, split, difference)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        result = differences(Path(folder))
    print(f"{'aggregation':24s} {'gradient':>10s} {'loss':>10s}  (largest relative difference over the cuts)")
    for name, row in result.items():
        print(f"{name:24s} {max(d['gradient'] for d in row.values()):10.2e} {max(d['loss'] for d in row.values()):10.2e}")
