"""The demo's reference data: a partial-rollout buffer kept in this process."""
from __future__ import annotations

PARTITION = "rollout"
FIELDS = ("prompt_ids", "response_ids", "log_probs", "reward", "text")


def make_buffer(n: int, total_bytes: int, seed: int = 0) -> dict:
    """A reference partial-rollout buffer: per-sample python lists of tensors, plus tags.

    Payload per sample ≈ 8*Lp (prompt int64) + 8*Lr (response int64) + 4*Lr (log-probs)
    + 4 (reward) + the text; 20% of the budget goes to the prompt, 80% to the response,
    lengths drawn uniformly in [0.25, 1.75] x the mean so the rows are really jagged.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    per = max(total_bytes / n, 64.0)
    mean_lp = max(per * 0.2 / 8, 2.0)
    mean_lr = max(per * 0.8 / 12, 2.0)

    def lengths(mean):
        f = torch.rand(n, generator=g) * 1.5 + 0.25
        return [max(1, int(round(mean * x))) for x in f.tolist()]

    lp, lr = lengths(mean_lp), lengths(mean_lr)
    prompt_flat = torch.randint(0, 151_936, (sum(lp),), generator=g, dtype=torch.int64)
    resp_flat = torch.randint(0, 151_936, (sum(lr),), generator=g, dtype=torch.int64)
    lp_flat = -torch.rand(sum(lr), generator=g, dtype=torch.float32) * 8.0
    prompts = list(torch.split(prompt_flat, lp))
    responses = list(torch.split(resp_flat, lr))
    logps = list(torch.split(lp_flat, lr))
    rewards = torch.randn(n, generator=g, dtype=torch.float32)
    texts = [f"sample {i}: réponse « {lr[i]} » tokens ✓" for i in range(n)]
    keys = [f"traj-{i:06d}" for i in range(n)]
    tags = [{"status": "running", "step": int(i % 97), "policy_version": int(3 + i % 5)}
            for i in range(n)]
    return {"keys": keys, "prompt_ids": prompts, "response_ids": responses, "log_probs": logps,
            "reward": rewards, "text": texts, "tags": tags}


def payload_bytes(buf: dict, idx=None) -> int:
    """Payload bytes of the samples ``idx`` (default: all) of a :func:`make_buffer` buffer."""
    idx = range(len(buf["keys"])) if idx is None else idx
    total = 0
    for i in idx:
        total += sum(buf[f][i].numel() * buf[f][i].element_size()
                     for f in ("prompt_ids", "response_ids", "log_probs"))
        total += 4 + len(buf["text"][i].encode())
    return total


def tensordict_of(buf: dict, lo: int, hi: int):
    """Samples ``lo:hi`` of a buffer as the TensorDict a rollout worker would put."""
    import torch
    from tensordict import TensorDict

    nt = torch.nested.nested_tensor
    return TensorDict({
        "prompt_ids": nt(buf["prompt_ids"][lo:hi], layout=torch.jagged),
        "response_ids": nt(buf["response_ids"][lo:hi], layout=torch.jagged),
        "log_probs": nt(buf["log_probs"][lo:hi], layout=torch.jagged),
        "reward": buf["reward"][lo:hi].clone(),
        "text": list(buf["text"][lo:hi]),
    }, batch_size=[hi - lo])
