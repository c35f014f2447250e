"""Line-by-line transcription of kvpress's KeyDiff, for kvreplay's `keydiff` scorer parity test.

Source: github.com/NVIDIA/kvpress, commit 8bb29b9c3078452a86d692f29123fa6c793e2b05:
  - kvpress/presses/keydiff_press.py, KeyDiffPress.score, lines 36-46;
  - kvpress/presses/scorer_press.py, ScorerPress.compress, lines 76-102: keep the top `n_kept`
    scores per KV head.
Deviations, marked `# deviation`: `n_kept` is given (the budget) instead of derived from a
compression ratio; positions are returned instead of gathered K/V; `topk` becomes `topk_stable`
(kvtrace.py); float32.

Usage: kvpress_keydiff.py TRACE BUDGET...; prints {"BUDGET": {"layers": [{"kept": [[positions] per
KV head], "scores": [[score per position] per KV head]}]}} as JSON.
"""

from torch.nn import functional as F

from kvtrace import run_budgets, top_positions


def score(keys):
    """KeyDiffPress.score, lines 45-46."""
    anchor = F.normalize(keys, p=2, dim=-1).mean(dim=2, keepdim=True)
    return -F.cosine_similarity(keys, anchor, dim=-1)


def run(layers, prompt_len, n_kept):
    out = []
    for _, k in layers:
        keys = k[:, :, :prompt_len, :]
        scores = score(keys)
        kept = top_positions(scores, n_kept, prompt_len)  # deviation: stable ties
        out.append({"kept": kept, "scores": scores[0].tolist()})
    return {"layers": out}




if __name__ == "__main__":
    run_budgets(run)
