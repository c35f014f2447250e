//! The replay engine: a policy (an [`allocator`] deciding how many tokens each layer keeps, a
//! [`head_split`] sharing a layer's budget among its caches, a [`scorer`] deciding which tokens,
//! a [`Timing`] deciding when, and a [`quantizer`], a key-[`channels`] rule and a [`merge`] rule
//! deciding how the kept entries are stored) is run over a trace, and [`metrics`] measure what the kept sets
//! cost the full cache's attention. Each axis is a registry of methods that declare their own
//! settings ([`settings`]).
//!
//! Policies consume a stream of steps: for each cache, tokens are appended one at a time and a
//! scorer state sees every append (a new key arrives; its query attends) and every eviction. The
//! same scorer code can therefore run inside a live forward pass. The engine works one layer at a
//! time (layers in parallel with rayon); results are bit-identical whatever the thread count,
//! because every layer is computed independently and collected in order.

pub mod allocator;
pub mod channels;
mod engine;
mod error;
pub mod head_split;
mod kept;
mod layer;
mod layout;
mod masks;
pub mod merge;
pub mod metrics;
mod plan;
mod policy;
pub mod presets;
mod profile;
mod protection;
pub mod quantizer;
#[cfg(any(test, feature = "reference"))]
pub mod reference;
mod rotary;
pub mod routing;
pub mod scorer;
mod select;
pub mod settings;
mod storage;
mod stream;
mod timing;

pub use allocator::{LayerBudget, Rounding};
pub use engine::{caches_per_layer, units};
pub use engine::{
    check_fit, compressed_layers, kept_sets, layer_budgets, nominal_budget, protocol_view, replay,
    replay_keeping, replay_many, Checkpoints, ReplayReport,
};
pub use error::{MethodFailed, PolicyError, Stopped};
pub use kept::selection_groups;
pub use layer::{context, LayerContext, Unit};
pub use layout::{Aggregation, Granularity, Layers};
pub use masks::{kept_masks, KeptMasks};
pub use metrics::{DecodeReference, LayerReport, Metric, SpanReport, RETAINED_MASS};
pub use policy::{
    all_methods, common_keys, parse_fraction, Common, External, ExternalMethods, PolicyParams,
    ValidPolicy, COMMON,
};
pub use profile::{entropy_profile, LayerEntropy, LayerProfile};
pub use protection::Protection;
pub use scorer::Pooling;
pub use select::{Kept, UnitKept};
pub use storage::{HeldCache, Storage};
pub use stream::{Attended, CacheStream};
pub use timing::{Order, Protocol, Timing, TimingSettings, Trigger};
