"""A small GPT-style byte-level language model and a corpus that needs no download (Python's own source)."""
from __future__ import annotations

import dataclasses
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256  # bytes: the same vocabulary on every machine, whatever the corpus holds


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    d_model: int = 256
    layers: int = 4
    heads: int = 4
    context: int = 128

    @classmethod
    def named(cls, size: str) -> "GPTConfig":
        """Preset sizes for the demo's --model option."""
        presets = {
            "tiny": cls(d_model=64, layers=2, heads=2, context=64),      # ~0.1M params, for tests
            "small": cls(d_model=256, layers=4, heads=4, context=128),   # ~3.3M params, the default
            "medium": cls(d_model=384, layers=6, heads=6, context=128),  # ~10.8M params
        }
        if size not in presets:
            raise ValueError(f"unknown model size {size!r}; choose from {', '.join(presets)}")
        return presets[size]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.ln1 = nn.LayerNorm(config.d_model)
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.out = nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(channels, dim=2)
        shape = (batch, time, self.heads, channels // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, time, channels))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token = nn.Embedding(VOCAB, config.d_model)
        self.position = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.Sequential(*[Block(config) for _ in range(config.layers)])
        self.ln = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, VOCAB, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token(tokens) + self.position(positions)
        return self.head(self.ln(self.blocks(x)))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(tokens)
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_model(config: GPTConfig, seed: int, dtype: torch.dtype, device: str) -> GPT:
    """The model with its FP32 initial weights (seeded), then cast for mixed precision."""
    torch.manual_seed(seed)
    return GPT(config).to(device=device, dtype=dtype)


class StdlibCorpus:
    """Bytes of the running Python's standard library source, in a fixed file order.

    Batches are drawn by step number alone, so a run restored after a crash sees exactly
    the data the uninterrupted run saw.
    """

    def __init__(self, max_bytes: int = 8 << 20, root: Path | None = None) -> None:
        root = root or Path(sysconfig.get_paths()["stdlib"])
        chunks, total = [], 0
        for path in sorted(root.glob("*.py")):
            data = path.read_bytes()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                break
        if total == 0:
            raise RuntimeError(f"no Python source found under {root}")
        self.data = torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()
        self.files = len(chunks)

    def __len__(self) -> int:
        return len(self.data)

    def batch(self, step: int, batch_size: int, context: int, seed: int = 0,
              device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.data) - context - 1, (batch_size,), generator=generator)
        rows = torch.stack([self.data[s : s + context + 1] for s in starts.tolist()])
        return rows[:, :-1].to(device), rows[:, 1:].to(device)

