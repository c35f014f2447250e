"""Line-by-line transcription of KIVI's quantized KV cache, for kvreplay's `kivi` quantizer parity
test: what each decode step's attention reads.

Source: github.com/jy-yuan/KIVI, commit 876b4d2:
  - quant/new_pack.py, triton_quantize_and_pack_along_last_dim, lines 217-249: groups of
    `group_size` along the last dimension, `mn`/`mx` per group, `scale = (mx - mn) / (2^bits - 1)`,
    `data = data - mn; data.div_(scale); data.clamp_(0, 2^bits - 1).round_()`;
  - quant/new_pack.py, unpack_and_dequant_vcache, lines 69-83: `data * scale + mn`;
  - models/llama_kivi.py, LlamaAttention_KIVI.forward: the prompt (lines 190-219: keys transposed
    and quantized per channel except the last `T mod residual_length`, values per token except the
    last `residual_length`) and each decode step (lines 104-179: the new key joins the full
    precision keys, which are quantized together once `residual_length` of them have gathered,
    after the step's attention; the new value joins the full precision values, and the oldest is
    quantized once more than `residual_length` are held, after the step's attention).
Deviations, marked `# deviation`: float32 throughout (KIVI runs float16); the integers are kept
unpacked (`pack_tensor`/`unpack_tensor` are lossless); the dequantized keys and values are returned
instead of attention computed over them; a constant group (scale 0, where KIVI divides by zero)
keeps its value, as kvreplay does.

Usage: kivi.py TRACE BITS GROUP_SIZE RESIDUAL; prints {"layers": [{"heads": [{"keys": [[[d floats]
per cached position] per decode step], "values": ...} per KV head]}]} as JSON.
"""
import sys

import torch

from kvtrace import emit, load, load_values


def quantize_and_dequantize_along_last_dim(data, group_size, bit):
    # triton_quantize_and_pack_along_last_dim, lines 217-241, and the dequantization of lines
    # 69-83, in float32.  # deviation
    shape = data.shape
    B, nh, D, T = shape
    assert T % group_size == 0
    num_groups = T // group_size
    new_shape = (B * nh * D, num_groups, group_size)
    data = data.reshape(new_shape).clone()
    mn = torch.min(data, dim=-1)[0]
    mx = torch.max(data, dim=-1)[0]
    scale = (mx - mn) / (2 ** bit - 1)
    constant = scale == 0  # deviation: a constant group keeps its value
    original = data.clone()
    data = data - mn.unsqueeze(-1)
    data.div_(scale.unsqueeze(-1))
    data = data.clamp_(0, 2 ** bit - 1).round_()
    data = data * scale.unsqueeze(-1) + mn.unsqueeze(-1)
    data[constant] = original[constant]
    return data.reshape(shape)


def quantize_values(values, group_size, bit):
    # The values are quantized along their last dimension (channels), as the model calls it.
    return quantize_and_dequantize_along_last_dim(values, group_size, bit)


def quantize_keys(keys, group_size, bit):
    # The keys are transposed first (`key_states_quant.transpose(2, 3)`), grouped along tokens.
    return quantize_and_dequantize_along_last_dim(
        keys.transpose(2, 3).contiguous(), group_size, bit
    ).transpose(2, 3)


def run_head(key_states, value_states, prompt_len, bits, group_size, residual_length):
    """key_states, value_states: [1, 1, T, d]. Per decode step, the keys and values its attention
    reads, in cache order."""
    # The prompt, lines 190-219.
    keys, values = key_states[:, :, :prompt_len], value_states[:, :, :prompt_len]
    if keys.shape[-2] % residual_length != 0:
        if keys.shape[-2] < residual_length:
            key_states_quant = None
            key_states_full = keys
        else:
            key_states_quant = keys[:, :, : -(keys.shape[-2] % residual_length), :].contiguous()
            key_states_full = keys[:, :, -(keys.shape[-2] % residual_length) :, :].contiguous()
    else:
        key_states_quant = keys
        key_states_full = None
    if key_states_quant is not None:
        key_states_quant = quantize_keys(key_states_quant, group_size, bits)
    if values.shape[-2] <= residual_length:
        value_states_quant = None
        value_states_full = values
    else:
        value_states_quant = values[:, :, :-residual_length, :].contiguous()
        value_states_full = values[:, :, -residual_length:, :].contiguous()
        value_states_quant = quantize_values(value_states_quant, group_size, bits)
    steps = []
    for position in range(prompt_len, key_states.shape[-2]):
        new_key = key_states[:, :, position : position + 1]
        new_value = value_states[:, :, position : position + 1]
        # Lines 121-129: the attention reads the quantized keys, then the full ones.
        if key_states_full is not None:
            key_states_full = torch.cat([key_states_full, new_key], dim=2)
        else:
            key_states_full = new_key
        read_keys = [t for t in (key_states_quant, key_states_full) if t is not None]
        read_keys = torch.cat(read_keys, dim=2)
        # Lines 131-144: quantized once `residual_length` full keys have gathered.
        if key_states_full.shape[-2] == residual_length:
            assert residual_length % group_size == 0
            new_quant = quantize_keys(key_states_full, group_size, bits)
            key_states_full = None
            if key_states_quant is not None:
                key_states_quant = torch.cat([key_states_quant, new_quant], dim=2)
            else:
                key_states_quant = new_quant
        # Lines 165-179: the attention reads the quantized values, then the full ones; the oldest
        # full value is quantized once more than `residual_length` are held.
        value_states_full = torch.cat([value_states_full, new_value], dim=2)
        read_values = [t for t in (value_states_quant, value_states_full) if t is not None]
        read_values = torch.cat(read_values, dim=2)
        if value_states_full.shape[-2] > residual_length:
            assert value_states_full.shape[-2] == residual_length + 1
            new_quant = quantize_values(value_states_full[:, :, :1, :].contiguous(), group_size, bits)
            value_states_full = value_states_full[:, :, 1:, :].contiguous()
            if value_states_quant is not None:
                value_states_quant = torch.cat([value_states_quant, new_quant], dim=2)
            else:
                value_states_quant = new_quant
        steps.append((read_keys[0, 0].tolist(), read_values[0, 0].tolist()))
    return steps


def main():
    path, bits, group_size, residual = sys.argv[1], *map(int, sys.argv[2:5])
    meta, layers = load(path)
    values = load_values(path)
    prompt_len = int(meta["prompt_len"])
    out = []
    for (_, k), v in zip(layers, values):
        heads = []
        for head in range(k.shape[1]):
            steps = run_head(
                k[:, head : head + 1], v[:, head : head + 1], prompt_len, bits, group_size, residual
            )
            heads.append({"keys": [s[0] for s in steps], "values": [s[1] for s in steps]})
        out.append({"heads": heads})
    emit({"layers": out})


if __name__ == "__main__":
    main()
