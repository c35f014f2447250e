#!/usr/bin/env python3
"""Capture a kvtrace/1 trace from any Hugging Face causal LM (transformers >= 5).

    python traces/capture_hf.py --model MODEL --recipe traces/niah-2k.toml --out trace.safetensors
        [--gguf-file FILE.gguf] [--dtype f16|bf16|f32] [--device cpu|cuda] [--layers 0,1,2]
        [--generate N] [--chunk 512] [--attention-inputs]

MODEL is a hub id or a local directory; with --gguf-file the weights come from that GGUF inside it
(e.g. --model ~/.cache/kvreplay/smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf). The recipe
is one of kvreplay's (`niah`, `chat`, `text`) and is built exactly as the native capture builds
it, in token space. Recording: a wrapping attention function is registered with transformers'
AttentionInterface (with the eager mask registered for it, so prefill stays causal); it stores
each layer's post-rotary q, the new positions' k and v, then runs eager attention. Scoring in
kvreplay is always f32; --dtype only sets the storage. The header carries the model's own heads,
head_dim, scale and soft-cap. --attention-inputs also records each layer's attention input (the
normed hidden states, `layers.{l}.input`, in the storage dtype) and its projections
(`layers.{l}.{q,k,v,o}_proj.weight` and `.bias`, f32), for the methods that read them; for models
that normalise q and k per head (Gemma 3, Qwen3), also those norms (`layers.{l}.{q,k}_norm.weight`,
the multiplier as applied: Gemma's `1 + weight`) and their ε (the header's `qk_norm_eps`).
A recipe with `reconstruction = "kvzip"` also records KVzip's reconstruction pass as kvpress's
KVzipPress lays it out (`reconstruction.tokens`, `layers.{l}.reconstruction.q`/`.k`, the header's
`reconstruction`; docs/trace-format.md): each chunk of the context before the question, after the
repeat instruction and the template's closing, run on a copy of the prompt's cache cut there.
"""
import argparse
import copy
import json
import os
import sys
import tomllib

import torch
from safetensors.torch import save_file
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

NIAH_SYSTEM = "You are a helpful AI bot that answers questions for a user. Keep your response short and direct"
NIAH_SUFFIX = " Don't give information outside the document or repeat your findings"

RECORD = {}  # layer -> {"q": [chunks], "k": [...], "v": [...], "input": [...]}
PASS = []  # the reconstruction pass's chunks: each layer -> {"q": [...], "k": [...]}
RECORDING = [RECORD]  # where the attention hook records: RECORD, or the pass's current chunk
WINDOWS = {}  # layer -> attention window (0 = global)
SCALES = {}  # layer -> softmax scale
LAYERS = None


def refuse(feature):
    sys.exit(f"capture_hf.py: this model uses {feature}, which kvreplay cannot replay faithfully yet; refusing to write a trace that would replay wrongly")


def check_config(config):
    """Refuses models whose attention a kvtrace/1 trace cannot describe."""
    if getattr(config, "attention_chunk_size", None):
        refuse("chunked attention (attention_chunk_size)")
    if getattr(config, "alibi", False) or getattr(config, "use_alibi", False) or config.model_type in ("bloom", "mpt"):
        refuse("ALiBi position biases")


def kvtrace_attention(module, query, key, value, attention_mask, **kwargs):
    layer = module.layer_idx
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        refuse("learned attention sinks (s_aux)")
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None) or 0
    WINDOWS.setdefault(layer, int(window))
    SCALES.setdefault(layer, float(kwargs.get("scaling") or module.scaling))
    if LAYERS is None or layer in LAYERS:
        new = query.shape[2]
        slot = RECORDING[-1].setdefault(layer, {"q": [], "k": [], "v": []})
        slot["q"].append(query[0].detach().float().cpu())
        slot["k"].append(key[0, :, -new:].detach().float().cpu())
        slot["v"].append(value[0, :, -new:].detach().float().cpu())
    return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)


def record_inputs(module, args, kwargs):
    """A forward pre-hook on a self-attention module: keeps the hidden states entering it."""
    if LAYERS is None or module.layer_idx in LAYERS:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        RECORDING[-1].setdefault(module.layer_idx, {"q": [], "k": [], "v": []}).setdefault("input", []).append(hidden[0].detach().float().cpu())


def attention_modules(model):
    """Each decoder layer's self-attention module, by layer index."""
    return {module.layer_idx: module for module in model.modules() if hasattr(module, "layer_idx") and hasattr(module, "k_proj")}


def projections(module):
    """The layer's four projections as `name -> tensor` (weights and the biases it has) and its
    per-head q/k norms where it has them, f32; and those norms' epsilon (None without them)."""
    found = {}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        linear = getattr(module, name)
        found[f"{name}.weight"] = linear.weight.detach().float().cpu().contiguous()
        if linear.bias is not None:
            found[f"{name}.bias"] = linear.bias.detach().float().cpu().contiguous()
    if not (hasattr(module, "q_norm") or hasattr(module, "k_norm")):
        return found, None
    epsilons = set()
    for name in ("q_norm", "k_norm"):
        found[f"{name}.weight"], eps = head_norm(getattr(module, name))
        epsilons.add(eps)
    if len(epsilons) != 1:
        refuse(f"q_norm and k_norm with different epsilons ({sorted(epsilons)})")
    return found, epsilons.pop()


def head_norm(norm):
    """A per-head RMS norm as a trace stores it: its multiplier as applied (Gemma's RMSNorm scales
    by `1 + weight`, Qwen3's and Llama's by `weight`), f32, and its epsilon."""
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    if eps is None or not hasattr(norm, "weight"):
        refuse(f"a per-head norm {type(norm).__name__} that is not an RMSNorm with a weight and an epsilon")
    weight = norm.weight.detach().float().cpu()
    if type(norm).__name__.startswith("Gemma"):
        weight = 1.0 + weight
    return weight.contiguous(), float(eps)


def sizes(config, head_dim, n_layers, positions, element, inputs):
    """What the trace will hold, in words, before the capture starts."""
    vectors = n_layers * positions * (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim * element
    line = f"capture_hf.py: up to {positions} positions x {n_layers} layers: q, k, v {vectors / 1e6:.1f} MB"
    if inputs:
        d, q, kv = config.hidden_size, config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        hidden = n_layers * positions * d * element
        weights = n_layers * 4 * (2 * q * d + 2 * kv * d)
        line += f", attention inputs {hidden / 1e6:.1f} MB, projections {weights / 1e6:.1f} MB"
    return line


def kvzip_rows(tokenizer, ids, cut, chunk):
    """KVzip's reconstruction rows, as kvpress 0.5.5's KVzipPress builds them (`__call__` lines
    95-114, `prepare` lines 185-226): the chat template's opening and closing from a dummy message,
    the context `ids[prefix:cut]` in chunks of `chunk` tokens, each after its repeat instruction
    (with the last 8 tokens of the chunk before, from the second on) and the template's closing.
    Returns [(start, end, rows)]."""
    if tokenizer.chat_template is None:
        prefix_text, suffix_text = "", "\n"
    else:
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}], add_generation_prompt=True, tokenize=False, enable_thinking=False)
        context, suffix_text = text.split(separator)
        prefix_text = context.split(dummy)[0]
    prefix, suffix = len(encode(tokenizer, prefix_text)), encode(tokenizer, suffix_text)
    context = ids[prefix:cut]
    pieces = [context[i : i + chunk] for i in range(0, len(context), chunk)]
    chunks, start = [], prefix
    for index, piece in enumerate(pieces):
        if index == 0:
            row = encode(tokenizer, "\n\nRepeat the previous context exactly.")
        else:
            row = encode(tokenizer, "\n\nRepeat the part of the previous context exactly, starting with") + pieces[index - 1][-8:]
        chunks.append((start, start + len(piece), row + suffix + piece))
        start += len(piece)
    return chunks


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def plain_template(tokenizer):
    """A tokenizer without a chat template (a base model) gets the plain-text template, as in
    kvreplay; any other is prompted through its own template."""
    return tokenizer.chat_template is None


def marker(i):
    """Stands for the i-th content: private-use characters no template writes (kvreplay's
    `ChatTemplate::around`)."""
    return f"\U000F0000{i}\U000F0001"


def around(tokenizer, system, user_turns):
    """The text the chat template writes around the contents of a conversation of an optional
    system message and `user_turns` user messages, the assistant's turn opened: `user_turns + 1`
    pieces, as kvreplay's `ChatTemplate::around` cuts them."""
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    messages += [{"role": "user", "content": marker(i)} for i in range(user_turns)]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pieces = []
    for i in range(user_turns):
        before, text = text.split(marker(i), 1)
        pieces.append(before)
    return pieces + [text]


def end_of_answer(tokenizer):
    """The token generation stops at: the first of what the template writes after an answer,
    where it is a special token, else EOS (kvreplay's rule)."""
    if plain_template(tokenizer):
        return tokenizer.eos_token_id
    conversation = [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker(0)}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    ids = encode(tokenizer, text.split(marker(0), 1)[1])
    return ids[0] if ids and ids[0] in tokenizer.all_special_ids else tokenizer.eos_token_id


def bos(tokenizer):
    """The BOS token a plain prompt starts with, if the tokenizer adds one."""
    return [tokenizer.bos_token_id] if getattr(tokenizer, "add_bos_token", False) and tokenizer.bos_token_id is not None else []


def build(recipe, base, tokenizer, essays_dir):
    kind = recipe["kind"]
    plain = plain_template(tokenizer)
    if kind == "chat":
        if plain:
            system = recipe.get("system")
            return bos(tokenizer) + encode(tokenizer, (system + "\n\n" if system else "") + recipe["message"]), []
        system = [{"role": "system", "content": recipe["system"]}] if "system" in recipe else []
        messages = system + [{"role": "user", "content": recipe["message"]}]
        return encode(tokenizer, tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)), []
    if kind == "text":
        with open(os.path.join(base, recipe["file"]), encoding="utf-8") as f:
            ids = bos(tokenizer) + encode(tokenizer, f.read())
        return ids[: recipe.get("max_tokens", len(ids))], []
    assert kind == "niah", f"unknown recipe kind {kind}"
    answer_prefix = recipe.get("answer_prefix", "")
    if plain:
        prefix = bos(tokenizer)
        between = encode(tokenizer, "\n\nQuestion: ")
        closing = encode(tokenizer, ("\nAnswer: " + answer_prefix).rstrip())
    else:
        opening, middle, end = around(tokenizer, NIAH_SYSTEM, 2)
        prefix, between = encode(tokenizer, opening), encode(tokenizer, middle)
        closing = encode(tokenizer, NIAH_SUFFIX + end + answer_prefix)
    question = encode(tokenizer, recipe["question"])
    needle = encode(tokenizer, "\n" + recipe["needle"].strip() + "\n")
    needed = max(0, recipe["prompt_tokens"] - len(prefix) - len(between) - len(question) - len(closing) - len(needle))
    text, context = "", []
    for name in sorted(f for f in os.listdir(essays_dir) if f.endswith(".txt")):
        with open(os.path.join(essays_dir, name), encoding="utf-8") as f:
            text += f.read()
        context = encode(tokenizer, text)
        if len(context) >= needed:
            break
    context = context[:needed]
    depth = recipe["depth_percent"]
    at = len(context) if depth >= 100 else int(len(context) * depth / 100)
    if depth < 100:
        while at > 0 and not tokenizer.decode([context[at - 1]]).endswith("."):
            at -= 1
    ids = prefix + context[:at]
    spans = [{"name": "needle", "start": len(ids), "end": len(ids) + len(needle)}]
    ids += needle + context[at:] + between
    spans.append({"name": "question", "start": len(ids), "end": len(ids) + len(question)})
    return ids + question + closing, spans


def main():
    global LAYERS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--gguf-file")
    p.add_argument("--recipe", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=["f16", "bf16", "f32"], default="f16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", help="comma-separated layer subset (default: all)")
    p.add_argument("--generate", type=int, help="greedy tokens (default: the recipe's)")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--attention-inputs", action="store_true", help="also record each layer's attention input and projection weights")
    p.add_argument("--essays", default=os.path.join(os.environ.get("KVREPLAY_HOME", os.path.expanduser("~/.cache/kvreplay")), "PaulGrahamEssays"))
    args = p.parse_args()
    AttentionInterface.register("kvtrace", kvtrace_attention)
    AttentionMaskInterface.register("kvtrace", eager_mask)
    kwargs = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(args.model, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="kvtrace", **kwargs).to(args.device).eval()
    config = model.config
    check_config(config)
    if args.layers:
        LAYERS = {int(x) for x in args.layers.split(",")}
    with open(args.recipe, "rb") as f:
        recipe = tomllib.load(f)
    ids, spans = build(recipe, os.path.dirname(args.recipe), tokenizer, args.essays)
    generate = args.generate if args.generate is not None else recipe["generate"]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    modules = attention_modules(model)
    n_layers = len(LAYERS) if LAYERS else len(modules)
    element = {"f16": 2, "bf16": 2, "f32": 4}[args.dtype]
    print(sizes(config, head_dim, n_layers, len(ids) + generate, element, args.attention_inputs), file=sys.stderr, flush=True)
    reconstruction = []
    if recipe.get("reconstruction") == "kvzip":
        cut = next((span["start"] for span in spans if span["name"] == "question"), len(ids))
        reconstruction = kvzip_rows(tokenizer, ids, cut, int(recipe.get("reconstruction_chunk", 2048)))
    weights, norm_epsilons = {}, set()
    if args.attention_inputs:
        for layer, module in modules.items():
            if LAYERS is None or layer in LAYERS:
                weights[layer], eps = projections(module)
                norm_epsilons.add(eps)
                module.register_forward_pre_hook(record_inputs, with_kwargs=True)
    if len(norm_epsilons) > 1:
        refuse(f"per-head q/k norms in some layers only, or with different epsilons ({norm_epsilons})")
    end_of_turn = end_of_answer(tokenizer)
    generated, past = [], None
    with torch.no_grad():
        for start in range(0, len(ids), args.chunk):
            piece = torch.tensor([ids[start : start + args.chunk]], device=args.device)
            out = model(input_ids=piece, past_key_values=past, use_cache=True)
            past = out.past_key_values
        for _, _, rows in reconstruction:
            RECORDING.append({})
            branch = copy.deepcopy(past)
            if branch.get_seq_length() > cut:
                branch.crop(cut - branch.get_seq_length())  # transformers 5: a negative count removes that many
            for start in range(0, len(rows), args.chunk):
                piece = torch.tensor([rows[start : start + args.chunk]], device=args.device)
                branch = model(input_ids=piece, past_key_values=branch, use_cache=True).past_key_values
            PASS.append(RECORDING.pop())
        while len(generated) < generate:
            token = int(out.logits[0, -1].argmax())
            if token == end_of_turn:
                break
            generated.append(token)
            out = model(input_ids=torch.tensor([[token]], device=args.device), past_key_values=past, use_cache=True)
            past = out.past_key_values
    layers = sorted(RECORD)
    storage = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
    tensors = {"tokens": torch.tensor(ids + generated, dtype=torch.int64)}
    for index, layer in enumerate(layers):
        for kind in ("q", "k", "v"):
            tensors[f"layers.{index}.{kind}"] = torch.cat(RECORD[layer][kind], dim=1).to(storage).contiguous()
        if args.attention_inputs:
            tensors[f"layers.{index}.input"] = torch.cat(RECORD[layer]["input"], dim=0).to(storage).contiguous()
            tensors.update({f"layers.{index}.{name}": weight for name, weight in weights[layer].items()})
    if reconstruction:
        tensors["reconstruction.tokens"] = torch.tensor([t for _, _, rows in reconstruction for t in rows], dtype=torch.int64)
        for index, layer in enumerate(layers):
            for kind in ("q", "k"):
                tensors[f"layers.{index}.reconstruction.{kind}"] = torch.cat([torch.cat(c[layer][kind], dim=1) for c in PASS], dim=1).to(storage).contiguous()
    if len(set(SCALES[layer] for layer in layers)) > 1:
        refuse(f"different softmax scales per layer ({sorted(set(SCALES.values()))})")
    scale = SCALES[layers[0]]
    meta = {
        "format": "kvtrace/1",
        "model": args.model + (f"/{args.gguf_file}" if args.gguf_file else ""),
        "n_layers": str(len(layers)),
        "n_heads": str(config.num_attention_heads),
        "n_kv_heads": str(config.num_key_value_heads),
        "head_dim": str(head_dim),
        "prompt_len": str(len(ids)),
        "rope": "post",
        "scale": repr(float(scale)),
        "prompt_text": tokenizer.decode(ids),
        "generated_text": tokenizer.decode(generated),
        "source": f"traces/capture_hf.py (transformers, attention hook); recipe {os.path.basename(args.recipe)}; chunk {args.chunk}; storage {args.dtype}; layers {layers if LAYERS else 'all'}{'; attention inputs' if args.attention_inputs else ''}",
    }
    if spans:
        meta["spans"] = json.dumps(spans)
    if norm_epsilons - {None}:
        meta["qk_norm_eps"] = repr(norm_epsilons.pop())
    if reconstruction:
        meta["reconstruction"] = json.dumps({"chunks": [[start, end, len(rows)] for start, end, rows in reconstruction]}, separators=(",", ":"))
    windows = [WINDOWS[layer] for layer in layers]
    if any(windows):
        meta["layer_windows"] = json.dumps(windows)
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        meta["softcap"] = repr(float(softcap))
    # The plain half-split rotary only (transformers 5's `rope_parameters` of rope_type
    # `default`): a scaled rotary is not described by one base, so the key is left out and
    # scorers that turn queries back refuse.
    parameters = getattr(config, "rope_parameters", None)
    if isinstance(parameters, dict) and "rope_theta" in parameters and parameters.get("rope_type", "default") == "default":
        meta["rope_theta"] = repr(float(parameters["rope_theta"]))
    # One plain rotary per layer type (`rope_parameters` keyed by `layer_types`, as Gemma 3
    # has: 10,000 for sliding layers, 1,000,000 for global ones).
    layer_types = getattr(config, "layer_types", None)
    if isinstance(parameters, dict) and layer_types and all(t in parameters for t in set(layer_types)):
        per_layer = [parameters[layer_types[layer]] for layer in layers]
        if all(p.get("rope_type", "default") == "default" for p in per_layer):
            meta["layer_rope_thetas"] = json.dumps([float(p["rope_theta"]) for p in per_layer])
    partial = args.out + f".partial.{os.getpid()}"
    save_file(tensors, partial, metadata=meta)
    os.replace(partial, args.out)
    print(f"{args.out}: {len(ids)} prompt + {len(generated)} generated tokens, {len(layers)} layers\ngenerated: {tokenizer.decode(generated)!r}")


if __name__ == "__main__":
    main()
