"""Hugging Face model families, built from a config (random init, no download).

Each family says how the plan library runs it: where its layers are (what PP
splits and GC wraps), how a pipeline stage computes (``embed`` on the first
stage, ``block`` per layer, ``head`` on the last), which modules only the first
or last stage keeps, and its TP plan: the model's own ``base_model_tp_plan``
where the config has one (LLaMA), otherwise one written here per family
(BERT, ViT, T5, GPT-2). GPT-2's layers are ``Conv1D`` (a linear layer with its
weight transposed) and its attention projects q, k and v with one fused
``c_attn``, which a column split would cut across q/k/v: ``build`` turns every
``Conv1D`` of its blocks into the ``nn.Linear`` of the same function
and ``c_attn`` into three of them whose outputs are concatenated
(``gpt2_layers``), under every plan, so each TP rank holds its heads
of q, k and v and the parameter names are the same for all plans.

T5 is two stacks (encoder, decoder): it runs whole (``whole``) instead of
stage by stage, GC and TP apply to the blocks of both (``layer_paths``), and
PP is refused (``why_no_pp``). Its TP plan splits every attention (self and
cross) by heads, the relative attention bias table included (an embedding
of one column per head, split colwise), and tells each attention it now holds
``heads / tp`` of them (``after_tp``).

Tiny sizes only (hidden 32, 4 layers, 4 heads): the point is that the same
code runs a real model on a real GPU. Dropout is off and word embeddings are
untied (a pipeline puts the embedding and the head on different stages).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gearshift.agent.torchplan.space import ModelShape

VOCAB, HIDDEN, LAYERS, HEADS, INTER, SEQ = 128, 32, 4, 4, 64, 16


@dataclass
class Family:
    name: str
    layers_path: str  # dotted path of the ModuleList PP splits
    first_only: tuple[str, ...]  # modules only the first stage keeps
    last_only: tuple[str, ...]
    tp_plan: dict[str, str] = field(default_factory=dict)  # layer-relative path -> colwise/rowwise
    why_no_tp: str = ""
    why_no_pp: str = ""
    masked: bool = False  # masked-LM data (BERT) instead of next-token

    def layer_paths(self) -> tuple[str, ...]:
        """Every ModuleList of layers (what GC wraps and TP and FSDP2 apply to)."""
        return (self.layers_path,)

    def tp_plan_of(self, path: str) -> dict[str, str]:
        """The TP plan of the layers under ``path``."""
        return self.tp_plan

    def after_tp(self, layer, tp: int) -> None:
        """Fix-ups of a layer after its TP split (its attention's local head count)."""

    # the model as one computation (``Staged`` calls it instead of embed/block/head); None: by stages
    whole = None

    # ---- the stage computation (the whole model when there is one stage)
    def embed(self, root, x):
        raise NotImplementedError

    def block(self, root, layer, h):
        out = layer(h)
        return out[0] if isinstance(out, tuple) else out

    def head(self, root, h):
        raise NotImplementedError


class Llama(Family):
    def embed(self, root, x):
        return root.model.embed_tokens(x)

    def block(self, root, layer, h):
        import torch

        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        pe = root.model.rotary_emb(h, pos)
        # attention_mask None + sdpa: causal (transformers' sdpa_attention_forward)
        return layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)

    def head(self, root, h):
        return root.lm_head(root.model.norm(h))


class GPT2(Family):
    def after_tp(self, layer, tp: int) -> None:
        # c_attn's output is now [q | k | v] of this rank's heads: split it by its third
        layer.attn.split_size //= tp
        layer.attn.num_heads //= tp

    def embed(self, root, x):
        import torch

        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        return root.transformer.wte(x) + root.transformer.wpe(pos)

    def head(self, root, h):
        return root.lm_head(root.transformer.ln_f(h))


class Bert(Family):
    def embed(self, root, x):
        return root.bert.embeddings(input_ids=x)

    def head(self, root, h):
        return root.cls(h)


class ViT(Family):
    def embed(self, root, x):
        emb = root.vit.embeddings
        # images come as float32; the patch projection may run in float64
        return emb(x.to(emb.patch_embeddings.projection.weight.dtype))

    def head(self, root, h):
        return root.classifier(root.vit.layernorm(h)[:, 0, :])  # the [CLS] token, as ViTForImageClassification


class T5(Family):
    def layer_paths(self) -> tuple[str, ...]:
        return ("encoder.block", "decoder.block")

    def tp_plan_of(self, path: str) -> dict[str, str]:
        return T5_DECODER_TP if path.startswith("decoder") else self.tp_plan

    def after_tp(self, layer, tp: int) -> None:
        # the cross-attention's zero position bias is shaped by n_heads; the rest views by -1
        for mod in layer.modules():
            if type(mod).__name__ == "T5Attention":
                mod.n_heads //= tp
                mod.inner_dim //= tp

    def whole(self, root, x):
        # a copy task with teacher forcing: the decoder reads the target shifted right
        return root(input_ids=x, decoder_input_ids=root._shift_right(x)).logits


def _t5_tp(layer_of: dict[str, str]) -> dict[str, str]:
    plan = {}
    for part, attn in layer_of.items():
        if attn == "ff":
            plan.update({f"{part}.DenseReluDense.wi": "colwise", f"{part}.DenseReluDense.wo": "rowwise"})
            continue
        plan.update({f"{part}.{attn}.{w}": "colwise" for w in ("q", "k", "v")})
        plan[f"{part}.{attn}.o"] = "rowwise"
        if attn == "SelfAttention":  # block 0 only: one column per head
            plan[f"{part}.{attn}.relative_attention_bias"] = "colwise"
    return plan


T5_ENCODER_TP = _t5_tp({"layer.0": "SelfAttention", "layer.1": "ff"})
T5_DECODER_TP = _t5_tp({"layer.0": "SelfAttention", "layer.1": "EncDecAttention", "layer.2": "ff"})

BERT_TP = {"attention.self.query": "colwise", "attention.self.key": "colwise", "attention.self.value": "colwise",
           "attention.output.dense": "rowwise", "intermediate.dense": "colwise", "output.dense": "rowwise"}

GPT2_TP = {"attn.c_attn.q": "colwise", "attn.c_attn.k": "colwise", "attn.c_attn.v": "colwise",
           "attn.c_proj": "rowwise", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}

VIT_TP = {"attention.q_proj": "colwise", "attention.k_proj": "colwise", "attention.v_proj": "colwise",
          "attention.o_proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
# ViT: 8x8 one-channel images in 2x2 patches (16 tokens, as SEQ), 4 classes
IMAGE, PATCH, CLASSES = 8, 2, 4

FAMILIES: dict[str, Family] = {
    "llama": Llama("llama", "model.layers", ("model.embed_tokens",), ("model.norm", "lm_head")),
    "gpt2": GPT2("gpt2", "transformer.h", ("transformer.wte", "transformer.wpe"), ("transformer.ln_f", "lm_head"),
                 tp_plan=dict(GPT2_TP)),
    "bert": Bert("bert", "bert.encoder.layer", ("bert.embeddings",), ("cls",), tp_plan=dict(BERT_TP), masked=True),
    "vit": ViT("vit", "vit.layers", ("vit.embeddings",), ("vit.layernorm", "classifier"), tp_plan=dict(VIT_TP)),
    "t5": T5("t5", "encoder.block", (), (), tp_plan=dict(T5_ENCODER_TP),
             why_no_pp="its encoder and decoder are two stacks, and every decoder layer reads the encoder's output"),
}


def config(name: str, layers: int = LAYERS, hidden: int = HIDDEN, heads: int = HEADS) -> Any:
    """The tiny transformers config of a family."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, tie_word_embeddings=False, attn_implementation="sdpa")
    if name == "llama":
        return tf.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                              num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4 * SEQ,
                              **common)
    if name == "gpt2":
        return tf.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=4 * SEQ, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0, **common)
    if name == "bert":
        return tf.BertConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                             num_attention_heads=heads, max_position_embeddings=4 * SEQ, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0, **common)
    if name == "vit":
        return tf.ViTConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                            num_attention_heads=heads, image_size=IMAGE, patch_size=PATCH, num_channels=1,
                            num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                            attn_implementation="sdpa")
    if name == "t5":
        return tf.T5Config(d_model=hidden, d_kv=hidden // heads, d_ff=2 * hidden, num_layers=layers,
                           num_decoder_layers=layers, num_heads=heads, dropout_rate=0.0, use_cache=False,
                           decoder_start_token_id=0, pad_token_id=0, **common)
    raise ValueError(f"model: unknown family {name!r} (one of {', '.join(FAMILIES)})")


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"model: unknown family {name!r} (one of {', '.join(FAMILIES)})")
    fam = FAMILIES[name]
    if name == "llama" and not fam.tp_plan:
        # the model's own TP plan: "layers.*.self_attn.q_proj" -> "self_attn.q_proj"
        import transformers as tf

        own = getattr(tf.LlamaConfig, "base_model_tp_plan", None) or {}
        fam.tp_plan = {k.split("layers.*.", 1)[1]: v for k, v in own.items() if k.startswith("layers.*.")}
    return fam


def shape(name: str, layers: int = LAYERS, hidden: int = HIDDEN, heads: int = HEADS) -> ModelShape:
    """What the plan checks need (no torch, no transformers import)."""
    fam = FAMILIES.get(name)
    if fam is None:
        raise ValueError(f"model: unknown family {name!r} (one of {', '.join(FAMILIES)})")
    has_tp = name == "llama" or bool(fam.tp_plan)
    return ModelShape(family=name, layers=layers, heads=heads, kv_heads=heads, hidden=hidden,
                      intermediate=2 * hidden, tp=has_tp, pp=not fam.why_no_pp, why_no_tp=fam.why_no_tp,
                      why_no_pp=fam.why_no_pp)


def build(name: str, seed: int = 1234, dtype: str = "float64", layers: int = LAYERS, hidden: int = HIDDEN,
          heads: int = HEADS):
    """The model with the same random init on every rank and under every plan."""
    import torch
    import transformers as tf

    cfg = config(name, layers, hidden, heads)
    torch.manual_seed(seed)
    cls = {"llama": tf.LlamaForCausalLM, "gpt2": tf.GPT2LMHeadModel, "bert": tf.BertForMaskedLM,
           "vit": tf.ViTForImageClassification, "t5": tf.T5ForConditionalGeneration}[name]
    model = cls(cfg).to(getattr(torch, dtype))
    if name == "bert":
        # cls.predictions.bias: unused by forward (the decoder has its own), so it never gets a gradient:
        # a plain Adam keeps no state for it, FSDP2's does, and one plan's checkpoint would not load
        # under the other's; drop it
        model.cls.predictions._parameters.pop("bias", None)
    if name == "gpt2":
        from gearshift.agent.torchplan.gpt2_layers import linearize

        linearize(model)
    model.train()
    return model



def dataset(name: str, n: int, seed: int, seq: int = SEQ):
    """A learnable synthetic set: for ViT random images labelled by their
    brightest quadrant; otherwise sequences of a fixed random Markov
    chain; BERT masks 3 fixed-per-sample positions (every micro-batch then has
    the same number of labels, so the mean of micro-batch means is the batch mean);
    T5 copies its input (the encoder reads it, the decoder writes it back)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if name == "vit":  # the class: the brightest quadrant
        x = torch.randn(n, 1, IMAGE, IMAGE, generator=g)
        q = IMAGE // 2
        quads = torch.stack([x[:, 0, :q, :q], x[:, 0, :q, q:], x[:, 0, q:, :q], x[:, 0, q:, q:]], 1)
        return x, quads.sum((2, 3)).argmax(1)
    nxt = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)
    toks = torch.empty(n, seq + 1, dtype=torch.long)
    toks[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(seq):
        toks[:, t + 1] = nxt[toks[:, t], torch.randint(0, 4, (n,), generator=g)]
    if name == "t5":
        return toks[:, :-1].contiguous(), toks[:, :-1].clone()
    if not FAMILIES[name].masked:
        return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()
    x = toks[:, :-1].clone()
    y = torch.full_like(x, -100)
    pos = torch.stack([torch.randperm(seq, generator=g)[:3] for _ in range(n)])
    rows = torch.arange(n).unsqueeze(1)
    y[rows, pos] = x[rows, pos]
    x[rows, pos] = 0  # the mask token
    return x, y


def loss_fn(logits, target):
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                             ignore_index=-100)


def params_m(name: str, layers: int = LAYERS, hidden: int = HIDDEN, heads: int = HEADS) -> float:
    """Millions of parameters of the model ``build`` makes (counted on a real instance)."""
    model = build(name, layers=layers, hidden=hidden, heads=heads, dtype="float32")
    return sum(p.numel() for p in model.parameters()) / 1e6


def model_spec(name: str, layers: int = LAYERS, hidden: int = HIDDEN, heads: int = HEADS) -> dict[str, Any]:
    """The job spec's ``model`` (what the performance model keys and scales by)."""
    return {"name": f"hf-{name}", "params": round(params_m(name, layers, hidden, heads), 6), "layers": layers,
            "hidden": hidden, "seq_len": SEQ, "heads": heads}
