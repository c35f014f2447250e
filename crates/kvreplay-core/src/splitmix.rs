//! SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA
//! 2014; the constants of Vigna's `splitmix64.c`): the one seeded mixer behind every random
//! number kvreplay draws — the random scorer's scores and the calibration's bootstrap resamples —
//! so both are reproducible from their seeds on any machine and thread count.

/// The generator's state increment (2^64 / the golden ratio).
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The next output of the generator whose state is `state`, advancing it.
pub fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(GAMMA);
    let mut x = *state;
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A 64-bit hash of `x`: the first output of the generator seeded with it.
pub fn hash(x: u64) -> u64 {
    next(&mut { x })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first five outputs of SplitMix64 seeded with 1234567, as Rosetta Code's task
    /// "Pseudo-random numbers/Splitmix64" gives them.
    #[test]
    fn matches_the_reference_stream() {
        let mut state = 1_234_567;
        let outputs: Vec<u64> = (0..5).map(|_| next(&mut state)).collect();
        assert_eq!(
            outputs,
            [
                6457827717110365317,
                3203168211198807973,
                9817491932198370423,
                4593380528125082431,
                16408922859458223821,
            ]
        );
        assert_eq!(hash(1_234_567), outputs[0]);
    }
}
