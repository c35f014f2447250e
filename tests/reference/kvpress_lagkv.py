"""Line-by-line transcription of kvpress's LagKV, for kvreplay's `lagkv` scorer parity test.

Source: github.com/NVIDIA/kvpress, commit 8bb29b9c3078452a86d692f29123fa6c793e2b05:
  - kvpress/presses/lagkv_press.py, LagKVPress.score and _get_states_score, lines 46-98;
  - kvpress/presses/scorer_press.py, ScorerPress.compress, lines 76-102: keep the top `n_kept`
    scores per KV head.
Deviations, marked `# deviation`: `n_kept` is given (the budget) instead of derived from a
compression ratio; positions are returned instead of gathered K/V; `topk` becomes `topk_stable`
(kvtrace.py); `argsort` is stable (ties by index); float32.

Usage: kvpress_lagkv.py TRACE LAG_SIZE N_SINK CROSS BUDGET...; prints {"BUDGET": {"layers":
[{"kept": [[positions] per KV head], "scores": [[score per position] per KV head]}]}} as JSON.
"""

import sys

import torch

from kvtrace import emit, load, load_values, top_positions


class LagKV:
    def __init__(self, lag_size, n_sink, cross_scoring):
        self.lag_size = lag_size
        self.n_sink = n_sink
        self.cross_scoring = cross_scoring

    def score(self, keys, values):
        """LagKVPress.score, lines 55-88."""
        bsz, num_key_value_heads, q_len, d = keys.shape
        if q_len < self.n_sink + 2 * self.lag_size:
            # no compression
            score = torch.ones((bsz, num_key_value_heads, q_len), dtype=keys.dtype, device=keys.device)
            if q_len > self.n_sink:
                # make sure the sliding part will be selected.
                score[:, :, self.n_sink :] = (
                    torch.arange(q_len - self.n_sink, device=keys.device) / (q_len - self.n_sink)
                ).to(keys.dtype)
            return score

        end_idx = self.n_sink + ((q_len - self.n_sink) // self.lag_size) * self.lag_size
        tail_len = self.lag_size + q_len - end_idx

        key_score = self._get_states_score(
            keys[:, :, self.n_sink : end_idx].reshape(bsz, num_key_value_heads, -1, self.lag_size, d)
        )
        value_score = self._get_states_score(
            values[:, :, self.n_sink : end_idx].reshape(bsz, num_key_value_heads, -1, self.lag_size, d)
        )
        # score is in range [0, 1]
        score = (key_score + value_score) / 2

        if not self.cross_scoring:
            # deviation: stable argsort (ties by index)
            score = score.argsort(dim=-1, stable=True).argsort(dim=-1, stable=True) / self.lag_size
            score = score.to(keys.dtype)
        # the parts should always keep
        sink_shape = (bsz, num_key_value_heads, self.n_sink)
        sink_score = torch.ones(sink_shape, dtype=score.dtype, device=score.device)
        tail_shape = (bsz, num_key_value_heads, tail_len)
        tail_score = torch.ones(tail_shape, dtype=score.dtype, device=score.device)
        score = torch.cat((sink_score, score.reshape(bsz, num_key_value_heads, -1), tail_score), dim=-1)
        return score

    def _get_states_score(self, target_v):
        """_get_states_score, lines 90-98."""
        ref = target_v[:, :, 1:, :, :]
        v = target_v[:, :, :-1, :, :]
        # lag-relative information
        min_r = ref.min(dim=-2).values.unsqueeze(-2).expand(-1, -1, -1, self.lag_size, -1)
        max_r = ref.max(dim=-2).values.unsqueeze(-2).expand(-1, -1, -1, self.lag_size, -1)

        score = ((v - min_r) / (max_r - min_r)).std(dim=-1).softmax(dim=-1)
        return score


def main():
    path, lag_size, n_sink, cross = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "true"
    meta, layers = load(path)
    values = load_values(path)
    prompt_len = int(meta["prompt_len"])
    press = LagKV(lag_size, n_sink, cross)
    result = {}
    for budget in sys.argv[5:]:
        out = []
        for (_, k), v in zip(layers, values):
            scores = press.score(k[:, :, :prompt_len, :], v[:, :, :prompt_len, :])
            kept = top_positions(scores, int(budget), prompt_len)  # deviation: stable ties
            out.append({"kept": kept, "scores": scores[0].tolist()})
        result[budget] = {"layers": out}
    emit(result)


if __name__ == "__main__":
    main()
