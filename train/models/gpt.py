"""`model=gpt`: a decoder-only transformer (GPT-2's layout, as nanoGPT writes it).

Token and position embeddings, `n_layer` pre-norm blocks (causal self-attention through
`torch.nn.functional.scaled_dot_product_attention`, then an MLP of 4 x n_embd), a final norm,
and a head tied to the token embedding. The vocabulary comes from the data (`vocab_size` is
filled from data=tokens' meta.json); the context `block_size` defaults to data.seq_len.

The blocks are `self.blocks`, a ModuleList of identical `Block`s: what FSDP wraps one by one.
Input: (batch, seq) int64 token ids; output: (batch, seq, vocab_size) logits.

`save_pretrained` writes it as `transformers`' GPT2LMHeadModel (the same layout: its Conv1D
weights are these Linear weights transposed; biases this model leaves out are zeros; exact
GELU), so that `from_pretrained` gives the same logits without this package.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 - torch's own spelling


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"model.n_embd={n_embd} must be a multiple of model.n_head={n_head}.")
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=bias), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=bias), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int = 256, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0, bias: bool = False,
                 tie_weights: bool = True, block_size: int | None = None) -> None:
        super().__init__()
        self.block_size = block_size or seq_len
        """The longest input (positions embedded): the context."""
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(self.block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.wte.weight
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2's initialisation, in place: also what distributed.fsdp.init_on=meta calls on
        each rank's shards once they exist (train/engine/fsdp.py)."""
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by depth
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.n_layer))
        for norm in (m for m in self.modules() if isinstance(m, nn.LayerNorm)):
            norm.reset_parameters()

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"input of {t} tokens, longer than the model's context "
                             f"block_size={self.block_size}.")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token as nanoGPT and PaLM (appendix B) count them: 6 per
        parameter (forward 2, backward 4; the position embedding, a lookup, left out) plus
        attention's 12 x layers x width x sequence length."""
        n = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        return 6.0 * n + 12.0 * self.n_layer * self.n_embd * seq_len

    @torch.no_grad()
    def to_transformers(self) -> nn.Module:
        """The same model as a transformers GPT2LMHeadModel (weights copied)."""
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=self.wte.num_embeddings, n_positions=self.block_size,
                            n_embd=self.n_embd, n_layer=self.n_layer, n_head=self.n_head,
                            activation_function="gelu", bos_token_id=None, eos_token_id=None,
                            tie_word_embeddings=self.lm_head.weight is self.wte.weight,
                            resid_pdrop=self.drop.p, embd_pdrop=self.drop.p,
                            attn_pdrop=self.drop.p)
        hf = GPT2LMHeadModel(config)
        ours = self.state_dict()
        theirs = {"transformer.wte.weight": ours["wte.weight"],
                  "transformer.wpe.weight": ours["wpe.weight"],
                  "lm_head.weight": ours["lm_head.weight"]}
        names = {"ln_1": "ln_1", "ln_2": "ln_2", "attn.c_attn": "attn.qkv",
                 "attn.c_proj": "attn.proj", "mlp.c_fc": "mlp.0", "mlp.c_proj": "mlp.2"}
        for i in range(self.n_layer):
            for hf_name, name in names.items():
                transpose = hf_name.startswith(("attn", "mlp"))  # Conv1D: (in, out)
                weight = ours[f"blocks.{i}.{name}.weight"]
                theirs[f"transformer.h.{i}.{hf_name}.weight"] = weight.t() if transpose \
                    else weight
                bias = ours.get(f"blocks.{i}.{name}.bias")
                theirs[f"transformer.h.{i}.{hf_name}.bias"] = torch.zeros(
                    weight.shape[0]) if bias is None else bias
        theirs["transformer.ln_f.weight"] = ours["ln_f.weight"]
        theirs["transformer.ln_f.bias"] = ours.get("ln_f.bias", torch.zeros(self.n_embd))
        hf.load_state_dict({k: v.detach().clone().contiguous() for k, v in theirs.items()})
        return hf.eval()

    def save_pretrained(self, folder: Path, tokenizer: str | None = None,
                        pad_tokens: tuple[str, ...] = ()) -> Path:
        """As train/models/hf.py's HFModel: the transformers model and the data's tokenizer."""
        from train.models.hf import HFModel

        return HFModel(self.to_transformers(), "input_ids").save_pretrained(folder, tokenizer,
                                                                            pad_tokens)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None) -> torch.Tensor:
        """`idx` (batch, t) continued by `new_tokens` sampled tokens (the context cropped to
        block_size)."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.block_size:])[:, -1, :] / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        return idx
