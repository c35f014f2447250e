//! A safetensors file's JSON header as bytes on disk, for what needs it outside the strict reader:
//! the writer's sorting of its own header, and an experiment's content hash of any trace file.

use std::io::Read;

/// The largest header safetensors accepts (its `MAX_HEADER_SIZE`, 100 MB).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// The header of the safetensors file `reader` is at the start of: its length in bytes and its
/// JSON. Objects come out with their keys sorted (serde_json's maps are ordered by key), so
/// `serde_json::to_vec` of it is the header's canonical form.
pub fn read_header(reader: &mut impl Read) -> std::io::Result<(usize, serde_json::Value)> {
    let mut length = [0u8; 8];
    reader.read_exact(&mut length)?;
    let length = u64::from_le_bytes(length);
    if length > MAX_HEADER_BYTES {
        return Err(std::io::Error::other(format!(
            "a safetensors header of {length} bytes (at most {MAX_HEADER_BYTES})"
        )));
    }
    let mut header = vec![0u8; length as usize];
    reader.read_exact(&mut header)?;
    let json = serde_json::from_slice(&header).map_err(std::io::Error::other)?;
    Ok((header.len(), json))
}
