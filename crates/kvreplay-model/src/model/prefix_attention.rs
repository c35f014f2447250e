//! Rows that continue one cache attend over it together. The policies of a prompt decode from
//! the full run's cache: each row's own cache holds only the positions after the prompt on the
//! global layers ([`KvCache::with_room_holding`]), and the prompt's keys and values, shared
//! ([`Row::prefix`]), are read once per layer and key-value head for every query of every row
//! instead of once per row from a copy of its own.
//!
//! Each query's result is the one it gets attending alone over a whole copy, bit for bit
//! ([`Prepared::attend_alone`]): its logits over the prompt come from one product of all the
//! rows' queries (each logit the same chain over the head's channels), those over its own
//! positions from its own keys; its softmax runs over the line the two make, under the same mask,
//! by the same operations; and each of its weighted-value sums runs over the prompt's positions
//! in one product of all the rows' weights, then goes on, term by term in the same order and by
//! the same multiply-adds ([`continue_chains`]), over its own positions.

use super::cached_attention::{Feed, Prepared};
use super::causal_lm::Row;
use super::masked_softmax::softmax_lines;
use super::product::{chain_product, continue_chains, with_rows};
use super::{KvCache, ModelError};
use candle_core::{Device, Tensor};
use rayon::prelude::*;

/// Queries at most in one product over a prefix: bounds the logits held at once (a query's are
/// its key-value head's query heads times the prefix's positions) while the prefix is still read
/// once for many rows.
const QUERIES_PER_PRODUCT: usize = 256;

/// Rows of weights one task sums over a prefix's values (a product of a head's width alone has
/// one column block, which one worker would otherwise take).
const ROWS_PER_TASK: usize = 48;

/// Each row's attention `[n_heads, n, d]` for its `prepared` queries: over its own cache alone,
/// or, where it continues a [`prefix`](Row::prefix) on this layer, together with the other rows
/// continuing the same one.
pub(crate) fn attend_prepared(
    rows: &[Row<'_, '_>],
    prepared: &[Prepared],
) -> Result<Vec<Tensor>, ModelError> {
    let continued: Vec<Option<(usize, usize)>> = rows
        .iter()
        .zip(prepared)
        .map(|(row, prepared)| continues(row, prepared))
        .collect();
    let mut attended: Vec<Option<Tensor>> = prepared
        .par_iter()
        .zip(&continued)
        .map(|(prepared, continued)| match continued {
            None => prepared.attend_alone().map(Some),
            Some(_) => Ok(None),
        })
        .collect::<Result<_, ModelError>>()?;
    let mut prefixes: Vec<(usize, usize)> = continued.iter().flatten().copied().collect();
    prefixes.sort_unstable();
    prefixes.dedup();
    for prefix in prefixes {
        let members: Vec<usize> = (0..rows.len())
            .filter(|&row| continued[row] == Some(prefix))
            .collect();
        let cache = rows[members[0]]
            .prefix
            .expect("a row continuing a prefix has one");
        let queries: Vec<&Prepared> = members.iter().map(|&row| &prepared[row]).collect();
        let outputs = attend_over_prefix(cache, prefix.1, &queries)?;
        for (row, output) in members.into_iter().zip(outputs) {
            attended[row] = Some(output);
        }
    }
    Ok(attended
        .into_iter()
        .map(|output| output.expect("every row attended"))
        .collect())
}

/// `(the prefix's address, the positions the row reads from it)` when `row`'s queries at this
/// layer read their first positions from its prefix: a global layer whose own cache starts after
/// position 0, each query attending as its own step would.
fn continues(row: &Row<'_, '_>, prepared: &Prepared) -> Option<(usize, usize)> {
    let start = prepared.held.2;
    let one_at_a_time = prepared.q.dims()[1] == 1 || prepared.geometry.feed == Feed::Steps;
    match row.prefix {
        Some(prefix) if prepared.geometry.window == 0 && start > 0 && one_at_a_time => {
            Some((std::ptr::from_ref(prefix) as usize, start))
        }
        _ => None,
    }
}

/// One query of a row: which row, and which of its tokens.
#[derive(Clone, Copy)]
struct Query {
    member: usize,
    token: usize,
}

/// What every query needs of its row: the queries in memory, `[n_heads, n, d]`.
struct Member<'p> {
    prepared: &'p Prepared,
    q: Vec<f32>,
    n: usize,
}

impl Member<'_> {
    /// Own positions query `token` sees: those its row's cache held before it, after the
    /// prefix, and its own and its row's earlier tokens'.
    fn seen(&self, token: usize) -> usize {
        self.prepared.past + token + 1 - self.prepared.held.2
    }

    /// The policy's mask line of query `token` at query head `head` over the `columns`
    /// positions up to its own, when the policy decides: the line its own step would get.
    fn policy_line(&self, token: usize, head: usize, columns: usize) -> Option<&[f32]> {
        let total = self.prepared.past + self.n;
        let mask = self.prepared.policy_mask.as_deref()?;
        Some(&mask[(head * self.n + token) * total..][..columns])
    }
}

/// The shapes of one layer's attention over a prefix.
#[derive(Clone, Copy)]
struct Heads {
    heads: usize,
    group: usize,
    d: usize,
    /// Positions the prefix gives.
    prefix: usize,
    scale: f64,
}

/// The attention `[n_heads, n, d]` of each of `prepared`'s rows, each continuing the first `len`
/// positions of `cache` at their layer.
fn attend_over_prefix(
    cache: &KvCache,
    len: usize,
    prepared: &[&Prepared],
) -> Result<Vec<Tensor>, ModelError> {
    let geometry = prepared[0].geometry;
    let (keys_t, values) = cache.layer_prefix(geometry.layer, len)?;
    let (kv_heads, d, _) = keys_t.dims3()?;
    let shape = Heads {
        heads: geometry.n_heads,
        group: geometry.n_heads / kv_heads,
        d,
        prefix: len,
        scale: geometry.scale,
    };
    let members = prepared
        .par_iter()
        .map(|&prepared| {
            let q = prepared.q.flatten_all()?.to_vec1::<f32>()?;
            let n = prepared.q.dims()[1];
            Ok(Member { prepared, q, n })
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let queries: Vec<Query> = members
        .iter()
        .enumerate()
        .flat_map(|(member, row)| (0..row.n).map(move |token| Query { member, token }))
        .collect();
    let mut outputs = vec![vec![0.0f32; shape.heads * d]; queries.len()];
    for (chunk, outputs) in queries
        .chunks(QUERIES_PER_PRODUCT)
        .zip(outputs.chunks_mut(QUERIES_PER_PRODUCT))
    {
        for kv in 0..kv_heads {
            let prefix = (
                keys_t.narrow(0, kv, 1)?.squeeze(0)?,
                values.narrow(0, kv, 1)?.squeeze(0)?,
            );
            let sums = kv_head_sums((&members, chunk), kv, &prefix, shape)?;
            for (output, sums) in outputs.iter_mut().zip(sums) {
                output[kv * shape.group * d..][..shape.group * d].copy_from_slice(&sums);
            }
        }
    }
    assemble(&members, &outputs, shape)
}

/// For each query of `chunk`, its key-value head `kv`'s query heads' weighted-value sums
/// `[group, d]`, over the prefix's keys transposed `[d, len]` and values `[len, d]` and then the
/// query's own positions.
fn kv_head_sums(
    (members, chunk): (&[Member<'_>], &[Query]),
    kv: usize,
    (keys_t, values): &(Tensor, Tensor),
    shape: Heads,
) -> Result<Vec<Vec<f32>>, ModelError> {
    let Heads {
        group, d, prefix, ..
    } = shape;
    let lines = chunk.len() * group;
    let mut stacked = Vec::with_capacity(lines * d);
    for query in chunk {
        stacked.extend(own_queries(&members[query.member], query.token, kv, shape));
    }
    let logits = chain_product(&stacked, (lines, d), keys_t)?;
    let weights = chunk
        .par_iter()
        .zip(logits.par_chunks_exact(group * prefix))
        .map(|(query, logits)| {
            query_weights(&members[query.member], query.token, (kv, logits), shape)
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let mut prefix_weights = Vec::with_capacity(lines * prefix);
    for (weights, columns) in &weights {
        for head in 0..group {
            prefix_weights.extend_from_slice(&weights[head * columns..][..prefix]);
        }
    }
    let partial: Vec<f32> = prefix_weights
        .par_chunks(ROWS_PER_TASK * prefix)
        .map(|rows| chain_product(rows, (rows.len() / prefix, prefix), values))
        .collect::<Result<Vec<_>, ModelError>>()?
        .concat();
    chunk
        .par_iter()
        .zip(weights)
        .zip(partial.par_chunks_exact(group * d))
        .map(|((query, weights), partial)| {
            own_sums(
                &members[query.member],
                query.token,
                kv,
                (&weights, partial),
                shape,
            )
        })
        .collect()
}

/// Query `token`'s heads of key-value head `kv` in `member`'s queries: `[group, d]`.
fn own_queries(member: &Member<'_>, token: usize, kv: usize, shape: Heads) -> Vec<f32> {
    let Heads { group, d, .. } = shape;
    let mut queries = Vec::with_capacity(group * d);
    for head in kv * group..(kv + 1) * group {
        queries.extend_from_slice(&member.q[(head * member.n + token) * d..][..d]);
    }
    queries
}

/// Query `token`'s softmax weights `[group, columns]` for key-value head `kv`'s query heads over
/// the prefix and its own positions (`columns` of them), from its logits over the prefix
/// `[group, len]`, under its policy's mask: as [`Prepared::attend_alone`] computes them.
fn query_weights(
    member: &Member<'_>,
    token: usize,
    (kv, prefix_logits): (usize, &[f32]),
    shape: Heads,
) -> Result<(Vec<f32>, usize), ModelError> {
    let Heads {
        group, d, prefix, ..
    } = shape;
    let seen = member.seen(token);
    let own_keys = member.prepared.held.0.narrow(0, kv, 1)?.squeeze(0)?;
    let own_keys = own_keys.narrow(1, 0, seen)?;
    let own = chain_product(
        &own_queries(member, token, kv, shape),
        (group, d),
        &own_keys,
    )?;
    let columns = prefix + seen;
    let mut line = Vec::with_capacity(group * columns);
    for head in 0..group {
        line.extend_from_slice(&prefix_logits[head * prefix..][..prefix]);
        line.extend_from_slice(&own[head * seen..][..seen]);
    }
    let policy = |head: usize| member.policy_line(token, kv * group + head, columns);
    let weights = softmax_lines(&line, (group, columns), shape.scale, policy);
    Ok((weights, columns))
}

/// Query `token`'s weighted-value sums `[group, d]` for key-value head `kv`: each head's `partial`
/// sums over the prefix, carried on over the query's own positions.
fn own_sums(
    member: &Member<'_>,
    token: usize,
    kv: usize,
    ((weights, columns), partial): (&(Vec<f32>, usize), &[f32]),
    shape: Heads,
) -> Result<Vec<f32>, ModelError> {
    let Heads { d, prefix, .. } = shape;
    let seen = member.seen(token);
    let own_values = member.prepared.held.1.narrow(0, kv, 1)?.squeeze(0)?;
    let own_values = own_values.narrow(0, 0, seen)?;
    let sums = with_rows(&own_values, |values, stride| {
        let mut sums = partial.to_vec();
        for (head, sums) in sums.chunks_exact_mut(d).enumerate() {
            let weights = &weights[head * columns + prefix..][..seen];
            continue_chains(sums, weights, (values, stride));
        }
        sums
    })?;
    sums.ok_or_else(|| ModelError::Mask("a row's cached values outside CPU memory".into()))
}

/// Each member's attention `[n_heads, n, d]` from its queries' sums `[n_heads, d]`, the queries
/// in member order.
fn assemble(
    members: &[Member<'_>],
    outputs: &[Vec<f32>],
    shape: Heads,
) -> Result<Vec<Tensor>, ModelError> {
    let Heads { heads, d, .. } = shape;
    let mut first = 0;
    members
        .iter()
        .map(|member| {
            let own = &outputs[first..first + member.n];
            first += member.n;
            let values: Vec<f32> = (0..heads)
                .flat_map(|head| own.iter().flat_map(move |sums| &sums[head * d..][..d]))
                .copied()
                .collect();
            Ok(Tensor::from_vec(
                values,
                (heads, member.n, d),
                &Device::Cpu,
            )?)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::cached_attention::{prepare_cached, LayerAttention};
    use crate::model::Evicted;

    const HEADS: usize = 6;
    const KV_HEADS: usize = 2;
    const D: usize = 8;
    const PROMPT: usize = 37;

    /// `[heads, n, D]` vectors at positions `from..from + n` that differ by head, position and
    /// channel.
    fn varied(heads: usize, (from, n): (usize, usize), salt: f32) -> Tensor {
        let values: Vec<f32> = (0..heads)
            .flat_map(|h| {
                (from..from + n).flat_map(move |p| {
                    (0..D).map(move |c| ((h * 13 + p * 7 + c) as f32 * 0.31 + salt).sin())
                })
            })
            .collect();
        Tensor::from_vec(values, (heads, n, D), &Device::Cpu).unwrap()
    }

    fn qkv(from: usize, n: usize) -> (Tensor, Tensor, Tensor) {
        (
            varied(HEADS, (from, n), 0.5),
            varied(KV_HEADS, (from, n), 1.5),
            varied(KV_HEADS, (from, n), 2.5),
        )
    }

    /// A row's case: the tokens its cache took after the prompt, the tokens of the pass, how they
    /// are fed, and whether a policy evicts some of the prompt's positions.
    #[derive(Clone, Copy)]
    struct Case {
        earlier: usize,
        n: usize,
        feed: Feed,
        evicts: bool,
    }

    /// Each case's attention over `caches` (continuing `prefix` where given).
    fn attended(cases: &[Case], caches: &mut [KvCache], prefix: Option<&KvCache>) -> Vec<Vec<f32>> {
        let mut masks: Vec<Evicted> = cases
            .iter()
            .map(|case| {
                let heads = (0..HEADS).map(|h| match case.evicts {
                    true => (0..PROMPT).filter(|p| (p + h) % 3 == 0).collect(),
                    false => Vec::new(),
                });
                vec![heads.collect()]
            })
            .collect();
        let mut rows: Vec<Row<'_, '_>> = caches
            .iter_mut()
            .zip(&mut masks)
            .zip(cases)
            .map(|((cache, mask), case)| {
                let mask: Option<&mut dyn crate::model::AttentionMask> = match case.evicts {
                    true => Some(mask),
                    false => None,
                };
                Row::new(&[], cache, mask).over_prefix(prefix)
            })
            .collect();
        let prepared: Vec<Prepared> = rows
            .iter_mut()
            .zip(cases)
            .map(|(row, case)| {
                let geometry = LayerAttention {
                    layer: 0,
                    n_heads: HEADS,
                    window: 0,
                    scale: 0.35,
                    feed: case.feed,
                };
                let past = PROMPT + case.earlier;
                prepare_cached(row, &geometry, past, qkv(past, case.n)).unwrap()
            })
            .collect();
        attend_prepared(&rows, &prepared)
            .unwrap()
            .iter()
            .map(|out| out.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect()
    }

    #[test]
    fn rows_over_a_shared_prefix_attend_as_over_whole_copies() {
        // A prompt of 37 positions, three query heads to each of two KV heads; rows that took 0,
        // 2, 5 and 1 tokens since, one token or several fed as steps, some under a policy that
        // evicts a third of the prompt: each row's attention reading the prompt from the shared
        // cache is its attention over a whole copy of its own, bit for bit.
        let mut prompt = KvCache::default();
        let (_, k, v) = qkv(0, PROMPT);
        prompt.append(0, k, v).unwrap();
        prompt.next_position = PROMPT;
        let case = |earlier, n, feed, evicts| Case {
            earlier,
            n,
            feed,
            evicts,
        };
        let cases = [
            case(0, 1, Feed::Chunk, false),
            case(2, 1, Feed::Chunk, true),
            case(5, 4, Feed::Steps, true),
            case(1, 3, Feed::Steps, false),
        ];
        let copies = |cases: &[Case], holding: &[usize]| -> Vec<KvCache> {
            cases
                .iter()
                .map(|case| {
                    let mut cache = prompt.with_room_holding(8, holding).unwrap();
                    if case.earlier > 0 {
                        let (_, k, v) = qkv(PROMPT, case.earlier);
                        cache.append(0, k, v).unwrap();
                        cache.next_position += case.earlier;
                    }
                    cache
                })
                .collect()
        };
        let mut whole = copies(&cases, &[usize::MAX]);
        let mut tails = copies(&cases, &[0]);
        assert_eq!(tails[0].keys(0).unwrap().dim(), (KV_HEADS, 0, D));
        let alone = attended(&cases, &mut whole, None);
        let together = attended(&cases, &mut tails, Some(&prompt));
        assert_eq!(together, alone);
        // The evicting policy changes the attention: the masks reach the shared path.
        let unmasked = [Case {
            evicts: false,
            ..cases[1]
        }];
        let mut tail = copies(&unmasked, &[0]);
        assert_ne!(
            attended(&unmasked, &mut tail, Some(&prompt))[0],
            together[1]
        );
    }
}
