"""Line-by-line transcription of kvpress's ChunkKV over its Knorm press, for kvreplay's `chunkkv`
scorer parity test.

Source: github.com/NVIDIA/kvpress, commit 8bb29b9c3078452a86d692f29123fa6c793e2b05:
  - kvpress/presses/chunkkv_press.py, ChunkKVPress.compress, lines 51-125;
  - kvpress/presses/knorm_press.py, KnormPress.score, line 38 (the inner press).
Deviations, marked `# deviation`: the number of chunks kept is the budget // chunk_length
instead of int(chunks * (1 - compression_ratio)) (kvreplay is given a budget in tokens);
positions are returned instead of gathered K/V; `topk` becomes `topk_stable` (kvtrace.py);
float32.

Usage: kvpress_chunkkv.py TRACE CHUNK_LENGTH BUDGET...; prints {"BUDGET": {"layers": [{"kept":
[[positions] per KV head], "scores": [[its chunk's score per position] per KV head]}]}} as JSON.
"""

import sys

import torch

from kvtrace import emit, load, topk_stable


def knorm_score(keys):
    """KnormPress.score, line 38."""
    return -keys.norm(dim=-1)


def chunkkv_kept(keys, chunk_length, budget):
    """ChunkKVPress.compress, lines 64-118: the sorted kept positions and each position's chunk
    score."""
    kv_len = keys.shape[2]

    # 1. Calculate global scores first
    global_scores = knorm_score(keys)

    # 2. Calculate actual number of complete chunks and remaining tokens
    num_complete_chunks = kv_len // chunk_length
    remaining_tokens = kv_len % chunk_length

    # Reshape complete chunks for score calculation
    if num_complete_chunks > 0:
        main_scores = global_scores[..., : num_complete_chunks * chunk_length]
        main_chunk_scores = main_scores.sum(dim=1).view(-1, num_complete_chunks, chunk_length)
        main_chunk_scores = main_chunk_scores.mean(dim=-1)
    else:
        main_chunk_scores = torch.empty((global_scores.shape[0], 0), device=global_scores.device)

    # Handle remaining tokens if any
    if remaining_tokens > 0:
        remaining_scores = global_scores[..., -remaining_tokens:]
        remaining_chunk_score = remaining_scores.sum(dim=1).mean(dim=-1, keepdim=True)
        chunk_scores = torch.cat([main_chunk_scores, remaining_chunk_score], dim=-1)
    else:
        chunk_scores = main_chunk_scores

    # 3. Calculate number of chunks to keep
    n_chunks_kept = max(1, budget // chunk_length)  # deviation: from the budget
    top_chunks = topk_stable(chunk_scores, n_chunks_kept)  # deviation: stable ties

    # 4. Create indices for selected chunks
    indices = []
    for chunk_idx in top_chunks[0]:
        if chunk_idx < num_complete_chunks:
            # For complete chunks
            start_idx = chunk_idx * chunk_length
            chunk_indices = torch.arange(start_idx, start_idx + chunk_length, device=keys.device)
        else:
            # For the remaining partial chunk
            chunk_indices = torch.arange(num_complete_chunks * chunk_length, kv_len, device=keys.device)
        indices.append(chunk_indices)

    indices = torch.cat(indices).sort()[0]
    per_position = [float(chunk_scores[0, min(j // chunk_length, chunk_scores.shape[1] - 1)]) for j in range(kv_len)]
    return indices.tolist(), per_position


def main():
    path, chunk_length = sys.argv[1], int(sys.argv[2])
    meta, layers = load(path)
    prompt_len = int(meta["prompt_len"])
    n_kv_heads = int(meta["n_kv_heads"])
    result = {}
    for budget in sys.argv[3:]:
        out = []
        for _, k in layers:
            kept, scores = chunkkv_kept(k[:, :, :prompt_len, :], chunk_length, int(budget))
            # One set of chunks for the layer: every KV head keeps it.
            out.append({"kept": [kept] * n_kv_heads, "scores": [scores] * n_kv_heads})
        result[budget] = {"layers": out}
    emit(result)


if __name__ == "__main__":
    main()
