"""kvreplay's transformers worker: runs a Hugging Face causal LM for kvreplay's engine, which keeps
the KV cache and computes attention itself.

Started by kvreplay (`crates/kvreplay-model/src/model/hf/mod.rs`) as `python -c <this file> MODEL [GGUF_FILE]`; speaks
on stdin/stdout in frames (a 4-byte little-endian length, a JSON header, then `header["bytes"]`
raw bytes). kvreplay asks for `encode`, `decode` and `forward`; during a forward the registered
attention function sends each layer's post-rotary q, k, v (f32, `[heads, n, d]`) and
receives the attention output kvreplay computed over its own cache with the policy's mask, so the
model never holds a cache of its own (it runs with `use_cache=False` and explicit positions).
KVREPLAY_HF_DEVICE (default cpu) and KVREPLAY_HF_DTYPE (f32, bf16 or f16; default f32) choose
where and in what the weights run; the vectors travel as f32.
"""
import json
import os
import struct
import sys

PROTOCOL = os.fdopen(os.dup(1), "wb")  # the frames; anything printed goes to stderr instead
os.dup2(2, 1)
REQUESTS = sys.stdin.buffer


class Refused(Exception):
    """A model feature kvreplay cannot run faithfully."""


class Aborted(Exception):
    """kvreplay stopped the forward pass (its policy failed)."""


def send(header, payload=b""):
    header = dict(header, bytes=len(payload))
    text = json.dumps(header).encode()
    PROTOCOL.write(struct.pack("<I", len(text)) + text + payload)
    PROTOCOL.flush()


def receive():
    size = REQUESTS.read(4)
    if len(size) < 4:
        sys.exit(0)
    header = json.loads(REQUESTS.read(struct.unpack("<I", size)[0]))
    return header, REQUESTS.read(header.get("bytes", 0))


def refuse_config(config):
    """The refusals of kvreplay's capture: attention a kvtrace/1 trace cannot describe."""
    if getattr(config, "attention_chunk_size", None):
        raise Refused("chunked attention (attention_chunk_size)")
    if getattr(config, "alibi", False) or getattr(config, "use_alibi", False) or config.model_type in ("bloom", "mpt"):
        raise Refused("ALiBi position biases")
    for key in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if getattr(config, key, None):
            raise Refused(f"attention logit soft-capping ({key})")


def kvreplay_attention(module, query, key, value, attention_mask, scaling=None, sliding_window=None, **kwargs):
    import torch

    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise Refused("learned attention sinks (s_aux)")
    if (sliding_window or 0) != WINDOWS[module.layer_idx]:
        raise Refused(f"a sliding window at layer {module.layer_idx} that its module does not declare")
    CALLS.append(module.layer_idx)
    _, heads, n, dim = query.shape
    vectors = torch.cat([t.detach().float().reshape(-1) for t in (query, key, value)])
    send({"op": "attend", "layer": module.layer_idx}, vectors.cpu().numpy().tobytes())
    header, payload = receive()
    if header["op"] != "attended":
        raise Aborted()
    out = torch.frombuffer(bytearray(payload), dtype=torch.float32).reshape(1, heads, n, dim)
    return out.to(device=query.device, dtype=query.dtype).transpose(1, 2).contiguous(), None


def no_mask(*args, **kwargs):
    return None


def attention_modules(model):
    return sorted((m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")), key=lambda m: m.layer_idx)


def end_of_answer(tokenizer):
    """The token generation stops at: the first of what the chat template writes after an
    answer, where it is a special token (`<|im_end|>`, `<|eot_id|>`), else EOS; kvreplay's rule
    for GGUF models."""
    marker = "\U000F0000"
    conversation = [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    ids = tokenizer.encode(text.split(marker, 1)[-1], add_special_tokens=False)
    return ids[0] if ids and ids[0] in tokenizer.all_special_ids else tokenizer.eos_token_id


def describe(model, tokenizer):
    """The model's geometry and template, as kvreplay's ModelSpec holds them."""
    config = model.config
    modules = attention_modules(model)
    scales = sorted({float(m.scaling) for m in modules})
    if len(scales) != 1:
        raise Refused(f"different softmax scales per layer ({scales})")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    chat = isinstance(tokenizer.chat_template, str)
    bos = tokenizer.bos_token_id if getattr(tokenizer, "add_bos_token", False) else None
    rope_theta = getattr(config, "rope_theta", None)
    if getattr(config, "rope_scaling", None):
        rope_theta = None
    thetas = []
    parameters, types = getattr(config, "rope_parameters", None), getattr(config, "layer_types", None)
    if isinstance(parameters, dict) and types and all(t in parameters for t in set(types)):
        per_layer = [parameters[types[m.layer_idx]] for m in modules]
        if all(p.get("rope_type", "default") == "default" for p in per_layer):
            thetas = [float(p["rope_theta"]) for p in per_layer]
    elif isinstance(parameters, dict) and parameters.get("rope_type", "default") == "default" and "rope_theta" in parameters:
        rope_theta = parameters["rope_theta"]
    return {
        "n_layers": len(modules),
        "n_heads": config.num_attention_heads,
        "n_kv_heads": config.num_key_value_heads,
        "head_dim": head_dim,
        "scale": scales[0],
        "windows": [WINDOWS[m.layer_idx] for m in modules],
        "rope_theta": float(rope_theta) if rope_theta and not thetas else None,
        "rope_thetas": thetas,
        "chat_template": tokenizer.chat_template if chat else None,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "bos": bos,
        "stop": end_of_answer(tokenizer) if chat else tokenizer.eos_token_id,
    }


def forward(model, header, device):
    """One sequence's forward pass (transformers' products are not batch-invariant, so kvreplay
    sends its rows one at a time)."""
    import torch

    ids = torch.tensor([header["ids"]], device=device)
    positions = torch.arange(header["position"], header["position"] + len(header["ids"]), device=device)[None]
    CALLS.clear()
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1).logits
    if CALLS != sorted(WINDOWS):
        raise Refused(f"an attention that does not go through transformers' AttentionInterface (layers {sorted(WINDOWS)} declared, {CALLS} called it)")
    send({"op": "logits"}, logits[0, -1].float().cpu().numpy().tobytes())


def main():
    model_id, gguf = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    device = os.environ.get("KVREPLAY_HF_DEVICE", "cpu")
    dtype_name = os.environ.get("KVREPLAY_HF_DTYPE", "f32")
    try:
        import torch
        import transformers
        from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:
        send({"op": "error", "message": f"{sys.executable} cannot import torch and transformers ({err}): set KVREPLAY_HF_PYTHON to a Python that has them (pip install -r traces/requirements-hf.txt)"})
        return
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    if dtype_name not in dtypes:
        send({"op": "error", "message": f"KVREPLAY_HF_DTYPE `{dtype_name}` is not one of f32, bf16, f16"})
        return
    AttentionInterface.register("kvreplay", kvreplay_attention)
    AttentionMaskInterface.register("kvreplay", no_mask)
    kwargs = {"gguf_file": gguf} if gguf else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_id, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtypes[dtype_name], attn_implementation="kvreplay", **kwargs)
        model = model.to(device).eval()
        refuse_config(model.config)
        for module in attention_modules(model):
            WINDOWS[module.layer_idx] = int(getattr(module, "sliding_window", None) or 0)
        if not WINDOWS:
            raise Refused(f"an attention implementation kvreplay cannot hook ({type(model).__name__} has no attention module with `layer_idx` and `scaling`)")
        engine = f"transformers {transformers.__version__} capture (torch {torch.__version__}, {dtype_name} on {device})"
        send(dict(describe(model, tokenizer), op="ready", engine=engine))
    except Refused as err:
        send({"op": "error", "message": f"this model uses {err}, which kvreplay cannot run faithfully yet"})
        return
    except Exception as err:  # the loader's own message names what is wrong
        send({"op": "error", "message": f"transformers cannot load it: {type(err).__name__}: {err}"})
        return
    while True:
        header, _ = receive()
        try:
            if header["op"] == "encode":
                send({"op": "encoded", "ids": tokenizer.encode(header["text"], add_special_tokens=False)})
            elif header["op"] == "decode":
                text = tokenizer.decode(header["ids"], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                send({"op": "decoded", "text": text})
            elif header["op"] == "forward":
                forward(model, header, device)
        except Aborted:
            send({"op": "aborted"})
        except Refused as err:
            send({"op": "error", "message": f"this model uses {err}, which kvreplay cannot run faithfully yet"})


WINDOWS = {}  # layer -> the attention window its module declares (0: global)
CALLS = []  # the layers whose attention ran in the current forward pass

if __name__ == "__main__":
    main()
