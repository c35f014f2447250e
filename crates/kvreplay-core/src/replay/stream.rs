//! One cache under a policy that is not one-shot, fed one position at a time: what its query
//! attends over and what the cache keeps after it. The open-loop replay feeds it a trace's layer;
//! the live model feeds it the layer's vectors as the model makes them. Under `gqa = layer` a
//! group of caches chooses one kept set together.

use super::merge::Eviction;
use super::scorer::{ScoreState, Scored, Scorer, Started};
use super::select::{select_top, victim};
use super::MethodFailed;
use super::{LayerContext, Order, Protection, Storage, Timing, Trigger, Unit, ValidPolicy};

/// What the query at one position attends over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attended {
    /// Every position up to its own (no eviction has touched the cache yet, or the timing keeps
    /// the whole prompt while it runs).
    Prefix,
    /// These positions, ascending.
    Entries(Vec<usize>),
}

impl Attended {
    /// The positions attended by the query at `position`.
    pub fn positions(self, position: usize) -> Vec<usize> {
        match self {
            Attended::Prefix => (0..=position).collect(),
            Attended::Entries(entries) => entries,
        }
    }

    /// Whether the query at `position` loses sight of any position up to its own.
    pub fn hides_any(&self, position: usize) -> bool {
        match self {
            Attended::Prefix => false,
            Attended::Entries(entries) => entries.len() <= position,
        }
    }
}

/// Several caches scored as one (`gqa = layer`): an entry's score is the mean of the caches'
/// scores, summed in cache order.
#[derive(Clone)]
struct Shared {
    states: Vec<Started>,
    buffer: Vec<f32>,
}

impl ScoreState for Shared {
    fn on_append(&mut self, layer: &LayerContext<'_>, cache: &[usize]) -> Scored {
        for state in &mut self.states {
            state.on_append(layer, cache)?;
        }
        Ok(())
    }

    fn scores(&mut self, layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        out.clear();
        out.resize(cache.len(), 0.0);
        for state in &mut self.states {
            state.scores(layer, cache, &mut self.buffer)?;
            for (total, score) in out.iter_mut().zip(&self.buffer) {
                *total += score;
            }
        }
        let n = self.states.len() as f32;
        for total in out.iter_mut() {
            *total /= n;
        }
        Ok(())
    }

    fn on_evict(&mut self, index: usize) -> Scored {
        self.states
            .iter_mut()
            .try_for_each(|state| state.on_evict(index))
    }

    fn on_slide_out(&mut self, index: usize) -> Scored {
        self.states
            .iter_mut()
            .try_for_each(|state| state.on_slide_out(index))
    }

    fn on_cut(&mut self, kept: &[bool]) -> Scored {
        self.states
            .iter_mut()
            .try_for_each(|state| state.on_cut(kept))
    }
}

/// Drops from the front of `cache` (positions, ascending) the entries that the arrival of
/// `position` slides out of the layer's attention window, telling `state`; nothing on a global
/// layer.
pub(crate) fn slide_out(
    layer: &LayerContext<'_>,
    position: usize,
    cache: &mut Vec<usize>,
    state: &mut dyn ScoreState,
) -> Scored {
    let first = layer.first_visible(position);
    let gone = cache.partition_point(|&cached| cached < first);
    for _ in 0..gone {
        cache.remove(0);
        state.on_slide_out(0)?;
    }
    Ok(())
}

/// A fresh scorer state for a group of caches that choose together.
pub(crate) fn start_group(
    scorer: &dyn Scorer,
    layer: &LayerContext<'_>,
    group: &[Unit],
    protect: Protection,
) -> Result<Started, MethodFailed> {
    match group {
        [unit] => scorer.start(layer, unit, protect),
        _ => Ok(Box::new(Shared {
            states: group
                .iter()
                .map(|unit| scorer.start(layer, unit, protect))
                .collect::<Result<_, _>>()?,
            buffer: Vec::new(),
        })),
    }
}

/// One cache (or group of caches choosing together) of `budget` tokens under a streaming or
/// re-selecting timing. Streaming evicts the lowest score from the first token over budget
/// (`streaming`), or after the whole prompt has been scored once and cut to the budget at its end
/// (`prefill-then-stream`, whose prompt queries attend over the whole prompt, as a prefill does);
/// under `order = attend-first` a query attends over the cache before its step's eviction
/// (`budget + 1` tokens). With an `interval` above 1 the cache instead grows until it holds
/// `budget + interval` tokens (or, with `trigger = position`, until a position divisible by the
/// interval arrives; with `trigger = steps`, until `interval` tokens have arrived since it was
/// last due) and one compression cuts it back to `budget` (the one-shot selection over the whole
/// cache, the last `window` entries and the sinks protected): kvpress's `DecodingPress`, R-KV.
/// Under `decoding` the prompt is never cut and every compression, from the first generated
/// token on, is such a cut back to `budget`, at any interval. Re-selection keeps every prompt token while the prompt runs, then
/// re-chooses at every decode step from the full cache (`per-step`), or from the prompt with every
/// generated token kept (`per-step-prompt`); the first `sinks` and the last `window` of the
/// positions it chooses from are always kept. On a sliding-window layer the cache holds only what
/// is inside the window: entries leave as they slide out ([`slide_out`]), whatever the timing.
/// Cloning forks the stream.
#[derive(Clone)]
pub struct CacheStream {
    state: Started,
    cache: Vec<usize>,
    scores: Vec<f32>,
    budget: usize,
    prompt_len: usize,
    timing: Timing,
    order: Order,
    interval: usize,
    trigger: Trigger,
    /// Tokens arrived since the trigger was last due (or since the timing began to compress).
    arrived: usize,
    /// The compressions made while decoding, kept for a merge that folds what they evict.
    evictions: Option<Vec<Eviction>>,
    /// Generated tokens arrived since the last compression.
    since_eviction: usize,
    protect: Protection,
}

impl CacheStream {
    /// A stream with nothing appended yet.
    pub fn start(
        layer: &LayerContext<'_>,
        group: &[Unit],
        budget: usize,
        policy: &ValidPolicy,
    ) -> Result<Self, MethodFailed> {
        let params = policy.params();
        let protect = policy.protection();
        let holds_prompt = params.timing != Timing::Streaming;
        Ok(Self {
            state: start_group(policy.scorer.as_ref(), layer, group, protect)?,
            cache: Vec::with_capacity(if holds_prompt {
                layer.prompt_len
            } else {
                budget + 1
            }),
            scores: Vec::with_capacity(budget + 1),
            budget,
            prompt_len: layer.prompt_len,
            timing: params.timing,
            order: policy.timing_settings().order,
            interval: policy.timing_settings().interval,
            trigger: policy.timing_settings().trigger,
            arrived: 0,
            evictions: matches!(policy.storage(), Storage::MergedWhileDecoding(_)).then(Vec::new),
            since_eviction: 0,
            protect,
        })
    }

    /// Appends `position` (the next one; `layer` holds it) and returns what its query attends
    /// over when `report` is set.
    pub fn push(
        &mut self,
        layer: &LayerContext<'_>,
        position: usize,
        report: bool,
    ) -> Result<Option<Attended>, MethodFailed> {
        slide_out(layer, position, &mut self.cache, self.state.as_mut())?;
        self.cache.push(position);
        self.state.on_append(layer, &self.cache)?;
        if self.timing.reselects() {
            self.reselect(layer, position, report)
        } else {
            self.stream(layer, position, report)
        }
    }

    fn whole_cache(&self, position: usize) -> Attended {
        if self.cache.len() == position + 1 {
            Attended::Prefix
        } else {
            Attended::Entries(self.cache.clone())
        }
    }

    fn stream(
        &mut self,
        layer: &LayerContext<'_>,
        position: usize,
        report: bool,
    ) -> Result<Option<Attended>, MethodFailed> {
        let decoding = position >= self.prompt_len;
        let cut_at_prompt_end = self.timing == Timing::PrefillThenStream;
        let attends_first = self.order == Order::AttendFirst || (cut_at_prompt_end && !decoding);
        let before = (report && attends_first).then(|| self.whole_cache(position));
        let streams_now = decoding || self.timing == Timing::Streaming;
        self.arrived += usize::from(streams_now);
        self.since_eviction += usize::from(decoding);
        if cut_at_prompt_end && position + 1 == self.prompt_len {
            let (protect, prompt_len) = (self.protect, self.prompt_len);
            self.cut(layer, position, move |j| protect.covers(j, prompt_len))?;
        } else if streams_now && (self.interval > 1 || self.timing.compresses_to_budget()) {
            let due = (self.cache.len(), position, self.arrived);
            if self.trigger.due(due, self.budget, self.interval) {
                self.arrived = 0;
                // The sinks and the cache's last `window` entries stay.
                let recent = self.cache.len().saturating_sub(self.protect.window);
                let first_recent = self.cache.get(recent).copied().unwrap_or(usize::MAX);
                let sinks = self.protect.sinks;
                self.cut(layer, position, move |j| j < sinks || j >= first_recent)?;
            }
        } else if streams_now && self.cache.len() > self.budget {
            self.state.scores(layer, &self.cache, &mut self.scores)?;
            if let Some(index) = victim(&self.cache, &self.scores, self.protect) {
                self.record(position, &[index]);
                self.cache.remove(index);
                self.state.on_evict(index)?;
            }
        }
        Ok(before.or_else(|| report.then(|| self.whole_cache(position))))
    }

    /// Cuts the cache to its `budget` best entries at once (the one-shot selection of
    /// [`select_top`], the positions `protected` says kept first) on the arrival of `position`,
    /// telling the state which entries went in one call.
    fn cut(
        &mut self,
        layer: &LayerContext<'_>,
        position: usize,
        protected: impl Fn(usize) -> bool,
    ) -> Scored {
        if self.cache.len() <= self.budget {
            return Ok(());
        }
        self.state.scores(layer, &self.cache, &mut self.scores)?;
        let kept = select_top(&self.cache, &self.scores, self.budget, protected);
        let marks: Vec<bool> = self
            .cache
            .iter()
            .map(|position| kept.binary_search(position).is_ok())
            .collect();
        let evicted: Vec<usize> = (0..marks.len()).filter(|&i| !marks[i]).collect();
        self.record(position, &evicted);
        self.cache = kept;
        self.state.on_cut(&marks)
    }

    /// Notes, for a merge that folds them, the entries (indices into the cache, whose scores
    /// are current) that the arrival of `position` evicts while decoding.
    fn record(&mut self, position: usize, evicted: &[usize]) {
        let Some(evictions) = self.evictions.as_mut() else {
            return;
        };
        if position < self.prompt_len {
            return;
        }
        let (cache, scores) = (&self.cache, &self.scores);
        let mut ranked = evicted.to_vec();
        ranked.sort_by(|&a, &b| {
            scores[b]
                .total_cmp(&scores[a])
                .then(cache[b].cmp(&cache[a]))
        });
        evictions.push(Eviction {
            position,
            effective_step: position - self.prompt_len
                + usize::from(self.order == Order::AttendFirst),
            ranked: ranked.into_iter().map(|i| cache[i]).collect(),
            merges: self.since_eviction,
        });
        self.since_eviction = 0;
    }

    /// The compressions made while decoding since the last call, when a merge needs them.
    pub fn take_evictions(&mut self) -> Option<Vec<Eviction>> {
        self.evictions.as_mut().map(std::mem::take)
    }

    fn reselect(
        &mut self,
        layer: &LayerContext<'_>,
        position: usize,
        report: bool,
    ) -> Result<Option<Attended>, MethodFailed> {
        if position < self.prompt_len || !report {
            return Ok(report.then(|| self.whole_cache(position)));
        }
        self.state.scores(layer, &self.cache, &mut self.scores)?;
        let limit = match self.timing {
            Timing::PerStepPrompt => self.prompt_len,
            _ => position + 1,
        };
        let protect = self.protect;
        let protected = |position: usize| protect.covers(position, limit);
        let split = self.cache.partition_point(|&cached| cached < limit);
        let mut kept = select_top(
            &self.cache[..split],
            &self.scores[..split],
            self.budget,
            protected,
        );
        kept.extend_from_slice(&self.cache[split..]);
        kept.shrink_to_fit();
        Ok(Some(Attended::Entries(kept)))
    }
}

#[cfg(test)]
mod tests {
    use super::Attended;

    #[test]
    fn a_query_hides_the_positions_its_entries_leave_out() {
        assert!(!Attended::Prefix.hides_any(5));
        assert!(!Attended::Entries(vec![0, 1, 2]).hides_any(2));
        assert!(Attended::Entries(vec![0, 2]).hides_any(2));
        assert!(Attended::Entries(vec![0, 1, 2]).hides_any(3));
    }
}
