//! The replay engine: a policy (an [`allocator`] deciding how many tokens each layer and cache
//! keeps, a [`scorer`] deciding which, and a [`Timing`] deciding when) is run over a trace, and
//! [`metrics`] measure what the kept sets cost the full cache's attention.
//!
//! Policies consume a stream of steps: for each cache, tokens are appended one at a time and a
//! scorer state sees every append (a new key arrives; its query attends) and every eviction. The
//! same scorer code can therefore run inside a live forward pass. The engine works one layer at a
//! time (layers in parallel with rayon); results are bit-identical whatever the thread count,
//! because every layer is computed independently and collected in order.

pub mod allocator;
mod engine;
mod error;
mod kept;
mod layer;
pub mod metrics;
mod policy;
pub mod presets;
mod profile;
pub mod scorer;
mod select;

pub use engine::{kept_sets, layer_budgets, replay, replay_many, ReplayReport};
pub use error::PolicyError;
pub use layer::{LayerContext, Unit};
pub use metrics::{DecodeReference, LayerReport, SpanReport};
pub use policy::{
    Aggregation, Granularity, HeadBudget, PolicyParams, Pooling, Rounding, Timing, ValidPolicy,
};
pub use profile::LayerProfile;
pub use select::{Kept, UnitKept};
