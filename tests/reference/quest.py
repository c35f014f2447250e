"""Line-by-line transcription of Quest's decode-time page selection, for kvreplay's `quest` preset
parity test.

Source: github.com/mit-han-lab/Quest, commit 01c1623, evaluation/quest_attention.py:
  - local_heavy_hitter_mask, lines 23-66: pages of `chunk_size` positions from position 0 (the
    last one padded), each page scored by the largest token weight in it, the top
    min(max(3, token_budget // chunk_size), pages) pages selected;
  - forward, lines 140-215: per query head (keys repeated per head), `sign` of the query,
    `max_key = key * sign`, its page-wise amax, `quantized_weight = |q| . chunk_max_key`, and
    `token_budget = min(kv_seq_len, self.token_budget)`.
Deviations, marked `# deviation`: positions are returned instead of attention computed over them;
every layer (Quest leaves layers 0 and 1 dense: `self.layer_id < 2`); one decode query at a time,
over the whole cache (decode steps only, as Quest); `topk` becomes `topk_stable` (kvtrace.py);
float32.

Usage: quest.py TRACE CHUNK_SIZE BUDGET...; prints {"BUDGET": {"layers": [{"steps": [[[positions
read] per decode step] per query head]}]}} as JSON.
"""
import sys

import torch

from kvtrace import emit, load, repeat_kv, topk_stable


def local_heavy_hitter_mask(attn_weights, token_budget, chunk_size):
    # attn_weights (BS, head, query, keys)

    # expend attn_weights to be divisible by chunk_size
    seq_length = attn_weights.shape[-1]
    padding_length = chunk_size - ((seq_length - 1) % chunk_size + 1)
    attn_weights = torch.cat(
        [
            attn_weights,
            torch.ones(
                (
                    attn_weights.shape[0],
                    attn_weights.shape[1],
                    attn_weights.shape[2],
                    padding_length,
                ),
                device=attn_weights.device,
            )
            * torch.tensor(torch.finfo(attn_weights.dtype).min),
        ],
        dim=-1,
    )

    # chunk attn_weights into chunk_size tokens
    chunk_attn_weights = attn_weights.reshape(
        attn_weights.shape[0],
        attn_weights.shape[1],
        attn_weights.shape[2],
        attn_weights.shape[3] // chunk_size,
        chunk_size,
    ).amax(dim=-1)

    topk = topk_stable(  # deviation: stable ties
        chunk_attn_weights, min(max(3, token_budget // chunk_size), chunk_attn_weights.size(-1))
    )
    # repeat topk chunk_size times and recover the original indexes (* chunk_size + arange(chunk_size))
    topk = topk.unsqueeze(-1).repeat(1, 1, 1, 1, chunk_size) * chunk_size + torch.arange(chunk_size, device=topk.device)
    topk = topk.reshape(topk.shape[0], topk.shape[1], topk.shape[2], -1)
    mask_bottom = torch.zeros_like(attn_weights, dtype=torch.bool)
    mask_bottom.scatter_(-1, topk, True)

    # remove the padding
    mask_bottom = mask_bottom[:, :, :, :seq_length]

    return mask_bottom


def select(query_states, key_states, chunk_size, budget):
    """forward, lines 140-215, from `sign` to `mask_bottom`: query [1, H, 1, d], keys [1, H, n, d]."""
    kv_seq_len = key_states.shape[-2]
    sign = (query_states > 0) + (~(query_states > 0)) * -1
    max_key = key_states * sign
    postive_query = query_states * sign

    # expend max_key to be divisible by chunk_size
    seq_length = max_key.shape[-2]
    padding_length = chunk_size - ((seq_length - 1) % chunk_size + 1)
    max_key = torch.cat(
        [
            max_key,
            torch.ones((max_key.shape[0], max_key.shape[1], padding_length, max_key.shape[3]), device=max_key.device)
            * torch.tensor(torch.finfo(max_key.dtype).min),
        ],
        dim=-2,
    )

    # chunk max_key into chunk_size tokens
    chunk_max_key = max_key.reshape(
        max_key.shape[0], max_key.shape[1], max_key.shape[2] // chunk_size, chunk_size, max_key.shape[3]
    ).amax(dim=-2)

    # duplicate chunk_max_key chunk_size times
    chunk_max_key = chunk_max_key.unsqueeze(-2).repeat(1, 1, 1, chunk_size, 1)
    # reshape chunk_max_key to the original shape
    chunk_max_key = chunk_max_key.reshape(chunk_max_key.shape[0], chunk_max_key.shape[1], -1, chunk_max_key.shape[-1])[
        :, :, :seq_length, :
    ]

    quantized_weight = torch.matmul(postive_query.float(), chunk_max_key.transpose(2, 3))
    token_budget = min(kv_seq_len, budget)
    return local_heavy_hitter_mask(quantized_weight, token_budget, chunk_size)


def main():
    meta, layers = load(sys.argv[1])
    chunk_size = int(sys.argv[2])
    prompt_len = int(meta["prompt_len"])
    result = {}
    for budget in [int(b) for b in sys.argv[3:]]:
        out = []
        for q, k in layers:
            heads, total = q.shape[1], q.shape[2]
            keys = repeat_kv(k, heads // k.shape[1])
            steps = [[] for _ in range(heads)]
            for position in range(prompt_len, total):
                mask = select(q[:, :, position : position + 1], keys[:, :, : position + 1], chunk_size, budget)
                for head in range(heads):
                    steps[head].append(torch.nonzero(mask[0, head, 0]).flatten().tolist())
            out.append({"steps": steps})
        result[str(budget)] = {"layers": out}
    emit(result)


if __name__ == "__main__":
    main()
