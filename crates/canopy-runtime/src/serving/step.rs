//! One step's description: everything a rank needs to do what rank 0 decided, so that every
//! rank's books and passes stay identical. Rank 0 sends it to each other rank before the step
//! (its length, then its bytes).

use crate::Result;
use canopy_comm::Collective;
use serde::{Deserialize, Serialize};

/// A request admitted this step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Admit {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub samples: u32,
    /// Report each prompt token's log-probability with this many likeliest tokens beside it
    /// (`None`: none). Such a prompt is computed whole, never read from the prefix cache.
    pub prompt_logprobs: Option<u32>,
}

impl Admit {
    /// The prompt's tokens that may be read from the prefix cache: all but the last, of a
    /// prompt whose rows' logits are not asked for.
    pub fn reusable(prompt: &[u32], prompt_logprobs: Option<u32>) -> &[u32] {
        match prompt_logprobs {
            Some(_) => &[],
            None => &prompt[..prompt.len().saturating_sub(1)],
        }
    }
}

/// One decode row: a sample of a request and the token it decodes (the one drawn last).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Row {
    pub id: u64,
    pub sample: u32,
    pub token: u32,
}

/// A prompt's tokens up to `end` prefilled this step (from where its KV ends).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Chunk {
    pub id: u64,
    pub end: u32,
}

/// What every rank does in one step, in this order: end, admit, decode, prefill.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Step {
    /// Requests that end (finished or cancelled): their own pages freed, their leases ended.
    pub end: Vec<u64>,
    /// Samples that ended while their request goes on.
    pub end_samples: Vec<(u64, u32)>,
    pub admit: Vec<Admit>,
    pub decode: Vec<Row>,
    /// The most likely tokens each decode row's logits are narrowed to on the backend, enough
    /// for every row's draw but those of `whole` (`None`: whole rows).
    pub reach: Option<usize>,
    /// Decode rows (request, sample) whose draw needs their whole logits, read whole beside
    /// the narrowed rows: those that change more logits than [`crate::sampling::PICKS_MAX`],
    /// or draw from more tokens than the backend narrows to.
    pub whole: Vec<(u64, u32)>,
    /// Narrowed decode rows (request, sample) that report their drawn token's
    /// log-probability: their log-normalisers and likeliest tokens are read beside them.
    pub terms: Vec<(u64, u32)>,
    /// Narrowed decode rows (request, sample) drawn over the whole vocabulary, with their
    /// temperatures: their softmax totals are read beside them.
    pub totals: Vec<((u64, u32), f32)>,
    /// Narrowed decode rows (request, sample) whose draws change logits, with the tokens
    /// whose logits are picked beside them (`Sampler::picks`). Rank 0 alone reads them, as
    /// it alone draws; they may run to thousands of tokens a row, and are not sent.
    #[serde(skip)]
    pub picks: Vec<((u64, u32), Vec<u32>)>,
    pub prefill: Vec<Chunk>,
    /// The engine stops after this step.
    pub stop: bool,
}

impl Step {
    /// Whether the step computes nothing (a heartbeat, or bookkeeping only).
    pub fn is_idle(&self) -> bool {
        self.decode.is_empty() && self.prefill.is_empty()
    }

    /// Rank 0 sends `self` to every other rank.
    pub fn send<C: Collective>(&self, comm: &C) -> Result<()> {
        let bytes = serde_json::to_vec(self).expect("a step serializes");
        let len = (bytes.len() as u64).to_le_bytes();
        for peer in 1..comm.size() {
            comm.send(&len, peer)?;
            comm.send(&bytes, peer)?;
        }
        Ok(())
    }

    /// A rank other than 0 receives rank 0's step.
    pub fn recv<C: Collective>(comm: &C) -> Result<Step> {
        let mut len = [0u8; 8];
        comm.recv(&mut len, 0)?;
        let mut bytes = vec![0u8; u64::from_le_bytes(len) as usize];
        comm.recv(&mut bytes, 0)?;
        serde_json::from_slice(&bytes).map_err(|e| {
            crate::RuntimeError::Protocol(format!("rank 0's step description is garbled: {e}"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use canopy_comm::{Group, ThreadWorld};
    use std::time::Duration;

    #[test]
    fn every_rank_receives_rank_0s_step() {
        let step = Step {
            end: vec![3],
            end_samples: vec![(4, 1)],
            admit: vec![Admit {
                id: 7,
                prompt: vec![1, 2, 3],
                samples: 2,
                prompt_logprobs: Some(1),
            }],
            decode: vec![Row {
                id: 4,
                sample: 0,
                token: 9,
            }],
            reach: Some(40),
            whole: vec![(4, 0)],
            terms: vec![(4, 1)],
            totals: vec![((4, 1), 0.7)],
            picks: Vec::new(),
            prefill: vec![Chunk { id: 7, end: 3 }],
            stop: false,
        };
        let got = ThreadWorld::run(3, Duration::from_secs(10), |comm| {
            if comm.rank() == 0 {
                step.send(&comm).map(|()| step.clone())
            } else {
                Step::recv(&comm)
            }
        });
        for g in got {
            assert_eq!(g.unwrap(), step);
        }
    }
}
