"""PyTorch CPU peer of bench_trainer: one training step (forward, backward, clip, AdamW) of a
GPT-2 of the same shape in fp32, written with torch.nn only (tanh GELU, tied LM head, pre-norm).
--autocast bf16 runs the forward and backward under torch.autocast("cpu", torch.bfloat16): bf16
matmuls with fp32 weights, gradients and AdamW, as trellis' bf16 Trainer does.
Prints one JSON line: {"ms_min": ..., "ms_median": ..., "threads": ...}.
  python3 torch_gpt2_step.py --layers 12 --heads 12 --width 768 --vocab 50257 --seq 64 --batch 4
"""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c, h):
        super().__init__()
        self.h = h
        self.ln_1 = nn.LayerNorm(c)
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)
        self.ln_2 = nn.LayerNorm(c)
        self.c_fc = nn.Linear(c, 4 * c)
        self.mlp_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, heads, width, vocab, positions):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(positions, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for b in self.h:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    p = argparse.ArgumentParser()
    for name, default in [("layers", 12), ("heads", 12), ("width", 768), ("vocab", 50257), ("seq", 64),
                          ("batch", 4), ("warmup", 1), ("iters", 3)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--autocast", choices=["none", "bf16"], default="none")
    a = p.parse_args()
    torch.manual_seed(0)
    model = GPT(a.layers, a.heads, a.width, a.vocab, max(a.seq, 1024))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    idx = torch.randint(0, a.vocab, (a.batch, a.seq))
    tgt = torch.randint(0, a.vocab, (a.batch, a.seq))

    def step():
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.autocast == "bf16"):
            loss = model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    for _ in range(a.warmup):
        step()
    times = []
    for _ in range(a.iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times.sort()
    print(json.dumps({"ms_min": times[0] * 1e3, "ms_median": times[len(times) // 2] * 1e3,
                      "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "autocast": a.autocast}))


if __name__ == "__main__":
    main()
