//! The transformers worker process (`worker.py`, embedded in the binary) and its frames: a
//! 4-byte little-endian length, a JSON header, then `header["bytes"]` raw bytes. One request at a
//! time, each answered before the next; the worker's stderr is drained on a thread and its last
//! lines kept for the error that names why it stopped.

use crate::model::ModelError;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};

/// The worker's source, run with `python -c`.
const SOURCE: &str = include_str!("worker.py");
/// The worker's stderr lines kept for error messages.
const KEPT_LINES: usize = 20;

/// A running worker.
pub(super) struct Worker {
    /// The model, as the recipe names it (for messages).
    model: String,
    child: Child,
    requests: BufWriter<ChildStdin>,
    replies: BufReader<ChildStdout>,
    stderr: Arc<Mutex<VecDeque<String>>>,
}

impl Worker {
    /// Starts `python` on the worker for `model_id` (and `gguf`, a GGUF file inside it) and
    /// returns it with its `ready` header, or the error the worker gave.
    pub fn start(
        python: &Path,
        model: &str,
        (model_id, gguf): (&str, Option<&str>),
    ) -> Result<(Self, Value), ModelError> {
        let mut command = Command::new(python);
        command.arg("-c").arg(SOURCE).arg(model_id).args(gguf);
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|err| ModelError::Hf {
                model: model.to_owned(),
                reason: format!("cannot start {}: {err}", python.display()),
            })?;
        let stderr = Arc::new(Mutex::new(VecDeque::new()));
        let lines = stderr.clone();
        let pipe = child.stderr.take().expect("piped");
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                let mut kept = lines.lock().expect("no reader panicked");
                if kept.len() == KEPT_LINES {
                    kept.pop_front();
                }
                kept.push_back(line);
            }
        });
        let mut worker = Self {
            model: model.to_owned(),
            requests: BufWriter::new(child.stdin.take().expect("piped")),
            replies: BufReader::new(child.stdout.take().expect("piped")),
            child,
            stderr,
        };
        let (ready, _) = worker.expect("ready")?;
        Ok((worker, ready))
    }

    /// Sends one frame.
    pub fn send(&mut self, header: Value, payload: &[u8]) -> Result<(), ModelError> {
        let mut header = header;
        header["bytes"] = json!(payload.len());
        let text = header.to_string();
        let sent = (|| {
            self.requests
                .write_all(&(text.len() as u32).to_le_bytes())?;
            self.requests.write_all(text.as_bytes())?;
            self.requests.write_all(payload)?;
            self.requests.flush()
        })();
        sent.map_err(|err| self.stopped(&format!("cannot write to it: {err}")))
    }

    /// Receives one frame: its header and payload. A worker's `error` frame is its error.
    pub fn receive(&mut self) -> Result<(Value, Vec<u8>), ModelError> {
        let mut size = [0u8; 4];
        if let Err(err) = self.replies.read_exact(&mut size) {
            return Err(self.stopped(&format!("it stopped ({err})")));
        }
        let mut text = vec![0u8; u32::from_le_bytes(size) as usize];
        let header: Value = match self.replies.read_exact(&mut text) {
            Ok(()) => serde_json::from_slice(&text)
                .map_err(|err| self.stopped(&format!("it sent a malformed frame ({err})")))?,
            Err(err) => return Err(self.stopped(&format!("it stopped ({err})"))),
        };
        let mut payload = vec![0u8; header["bytes"].as_u64().unwrap_or(0) as usize];
        if let Err(err) = self.replies.read_exact(&mut payload) {
            return Err(self.stopped(&format!("it stopped mid-frame ({err})")));
        }
        if header["op"] == "error" {
            return Err(self.failure(header["message"].as_str().unwrap_or("unknown failure")));
        }
        Ok((header, payload))
    }

    /// Receives one frame, which must be `op`.
    pub fn expect(&mut self, op: &str) -> Result<(Value, Vec<u8>), ModelError> {
        let (header, payload) = self.receive()?;
        if header["op"] != op {
            return Err(self.failure(&format!("expected `{op}`, it sent {header}")));
        }
        Ok((header, payload))
    }

    /// The error `reason` of this worker's model.
    pub fn failure(&self, reason: &str) -> ModelError {
        ModelError::Hf {
            model: self.model.clone(),
            reason: reason.to_owned(),
        }
    }

    /// The error of a worker that stopped answering: `what`, then its last stderr lines.
    fn stopped(&mut self, what: &str) -> ModelError {
        // Give the stderr thread the worker's last words.
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::thread::sleep(std::time::Duration::from_millis(50));
        let lines = self.stderr.lock().expect("no reader panicked");
        let tail: Vec<&str> = lines.iter().map(String::as_str).collect();
        self.failure(&format!(
            "the transformers worker failed: {what}; its last output:\n{}",
            tail.join("\n")
        ))
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
