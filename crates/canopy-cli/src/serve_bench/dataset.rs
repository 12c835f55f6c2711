//! The requests of a serving benchmark, drawn from a seed: random prompts, or prompts that
//! share prefixes the way real workloads do.
//!
//! Prompts are token ids (sent as they are, so every length is exact): uniform draws below the
//! server's vocabulary. A shared-prefix dataset is a tree of segments — the prefix every
//! request shares, then each level's branches — and each request is one root-to-leaf path of
//! it followed by a question of its own:
//!
//! | dataset | tree | what it stands for |
//! |---|---|---|
//! | `few-shot` | one prefix | many questions behind one long prompt of examples |
//! | `multi-doc` | instructions, then `groups` documents | questions about one of several documents |
//! | `multi-chain` | a problem, then `depth` steps branching `branching` ways | reasoning chains that share their first steps |
//! | `system-prompt` | a system prompt, then `groups` application prompts | a multi-level system prompt |
//!
//! Requests go to the leaves in turn (request `i` to leaf `i mod leaves`), then are shuffled:
//! requests of one prefix arrive interleaved with others. Every request asks for its exact
//! output length (the server is told to ignore end-of-sequence tokens).

use clap::{Args, ValueEnum};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::collections::HashMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DatasetKind {
    /// Prompts of random tokens, nothing shared.
    Random,
    /// One long prompt of examples shared by every request.
    FewShot,
    /// Short instructions shared by all, then one of several documents.
    MultiDoc,
    /// A problem, then reasoning steps that branch: chains share their first steps.
    MultiChain,
    /// A system prompt shared by all, then one of several application prompts.
    SystemPrompt,
}

impl DatasetKind {
    /// The name `--dataset` takes.
    pub fn name(self) -> String {
        self.to_possible_value()
            .map_or_else(String::new, |v| v.get_name().to_string())
    }
}

/// The dataset and its lengths (tokens). Lengths left out take the dataset's defaults.
#[derive(Args, Debug, Clone)]
pub struct DatasetArgs {
    #[arg(long, value_enum, default_value = "random")]
    pub dataset: DatasetKind,
    /// Prompt tokens of a `random` request.
    #[arg(long, default_value_t = 1024, value_parser = crate::bench::at_least_one)]
    pub input_len: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 128, value_parser = crate::bench::at_least_one)]
    pub output_len: usize,
    /// Each request's own lengths (random prompt, question, output) are drawn uniformly
    /// within ± this share of the length asked.
    #[arg(long, default_value_t = 0.0, value_parser = ratio)]
    pub range_ratio: f64,
    /// The prefix every request shares: the examples, instructions, problem or system prompt
    /// [default: 4096, 256, 1024, 2048 by dataset].
    #[arg(long)]
    pub prefix_len: Option<usize>,
    /// Documents (multi-doc) or application prompts (system-prompt) [default: 8, 4].
    #[arg(long, value_parser = crate::bench::at_least_one)]
    pub groups: Option<usize>,
    /// Tokens of each document or application prompt [default: 2048, 1024].
    #[arg(long)]
    pub group_len: Option<usize>,
    /// Multi-chain: the ways each reasoning step branches.
    #[arg(long, default_value_t = 4, value_parser = crate::bench::at_least_one)]
    pub branching: usize,
    /// Multi-chain: the reasoning steps of each chain.
    #[arg(long, default_value_t = 3, value_parser = crate::bench::at_least_one)]
    pub depth: usize,
    /// Multi-chain: tokens of each reasoning step.
    #[arg(long, default_value_t = 256, value_parser = crate::bench::at_least_one)]
    pub step_len: usize,
    /// Tokens of each request's own question, after its shared prefix [default: 64, or 16
    /// for multi-chain].
    #[arg(long, value_parser = crate::bench::at_least_one)]
    pub question_len: Option<usize>,
}

fn ratio(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if (0.0..1.0).contains(&r) => Ok(r),
        Ok(_) => Err("a range ratio is at least 0 and below 1".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// One request: its prompt and how many tokens it asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub output_len: usize,
}

/// A dataset's shape as drawn: what the report states.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Shape {
    pub dataset: DatasetKind,
    /// Each level of the shared tree, root first: `(branches, tokens of each)`.
    pub levels: Vec<(usize, usize)>,
    /// Tokens of each request's own part (the whole prompt for `random`).
    pub own_len: usize,
    pub output_len: usize,
    pub range_ratio: f64,
}

impl Shape {
    /// The tree's leaves: the distinct shared prefixes requests end on (`usize::MAX` for a
    /// tree with more).
    pub fn leaves(&self) -> usize {
        (self.levels.iter()).fold(1usize, |leaves, &(n, _)| leaves.saturating_mul(n))
    }

    /// Tokens of a leaf's whole shared prefix.
    pub fn shared_len(&self) -> usize {
        self.levels.iter().map(|&(_, len)| len).sum()
    }
}

impl DatasetArgs {
    /// The tree and lengths this dataset draws from.
    pub fn shape(&self) -> Shape {
        use DatasetKind::*;
        let question = self.question_len.unwrap_or(match self.dataset {
            MultiChain => 16,
            _ => 64,
        });
        let prefix = |default: usize| (1, self.prefix_len.unwrap_or(default));
        let groups =
            |n: usize, len: usize| (self.groups.unwrap_or(n), self.group_len.unwrap_or(len));
        let levels = match self.dataset {
            Random => Vec::new(),
            FewShot => vec![prefix(4096)],
            MultiDoc => vec![prefix(256), groups(8, 2048)],
            MultiChain => std::iter::once(prefix(1024))
                .chain(std::iter::repeat_n(
                    (self.branching, self.step_len),
                    self.depth,
                ))
                .collect(),
            SystemPrompt => vec![prefix(2048), groups(4, 1024)],
        };
        Shape {
            dataset: self.dataset,
            levels,
            own_len: match self.dataset {
                Random => self.input_len,
                _ => question,
            },
            output_len: self.output_len,
            range_ratio: self.range_ratio,
        }
    }
}

impl Shape {
    /// `n` requests with token ids below `vocab`, drawn from `seed`. Request `i` ends on leaf
    /// `i` of the tree (modulo its leaves), and only the nodes on those leaves' paths are
    /// drawn, each from its own stream of `seed`, so a deep tree costs what its requests read.
    pub fn draw(&self, n: usize, vocab: u32, seed: u64) -> Vec<Request> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let tokens = |rng: &mut ChaCha8Rng, len: usize| -> Vec<u32> {
            (0..len).map(|_| rng.gen_range(0..vocab)).collect()
        };
        // Node j of level l hangs under node j / branches(l) of level l - 1; it is drawn once,
        // from the stream numbered by its level and index.
        let mut nodes: HashMap<(usize, usize), Vec<u32>> = HashMap::new();
        let mut node = |level: usize, index: usize, len: usize| -> Vec<u32> {
            let drawn = nodes.entry((level, index)).or_insert_with(|| {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                rng.set_stream(((level as u64) << 48) ^ index as u64 ^ (1 << 63));
                tokens(&mut rng, len)
            });
            drawn.clone()
        };
        let leaves = self.leaves();
        let mut requests: Vec<Request> = (0..n)
            .map(|i| {
                let leaf = i % leaves;
                let mut prompt = Vec::new();
                // The leaf's index at each level, from the last level up.
                let mut path = Vec::with_capacity(self.levels.len());
                let mut index = leaf;
                for &(branches, _) in self.levels.iter().rev() {
                    path.push(index);
                    index /= branches;
                }
                for (level, (&(_, len), &index)) in
                    self.levels.iter().zip(path.iter().rev()).enumerate()
                {
                    prompt.extend(node(level, index, len));
                }
                let own = self.vary(&mut rng, self.own_len);
                prompt.extend(tokens(&mut rng, own));
                Request {
                    prompt,
                    output_len: self.vary(&mut rng, self.output_len),
                }
            })
            .collect();
        requests.shuffle(&mut rng);
        requests
    }

    /// `len` varied uniformly within ± the range ratio, at least 1.
    fn vary(&self, rng: &mut ChaCha8Rng, len: usize) -> usize {
        let spread = (len as f64 * self.range_ratio).floor() as usize;
        if spread == 0 {
            return len;
        }
        rng.gen_range(len.saturating_sub(spread).max(1)..=len + spread)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        d: DatasetArgs,
    }

    fn shape(args: &str) -> Shape {
        Cli::parse_from(std::iter::once("x").chain(args.split_whitespace()))
            .d
            .shape()
    }

    fn common(a: &[u32], b: &[u32]) -> usize {
        a.iter().zip(b).take_while(|(x, y)| x == y).count()
    }

    #[test]
    fn few_shot_requests_share_the_prefix_and_nothing_after_it() {
        let s = shape("--dataset few-shot --prefix-len 300 --question-len 20 --output-len 7");
        let r = s.draw(10, 50_000, 1);
        assert_eq!(r.len(), 10);
        for x in &r {
            assert_eq!(x.prompt.len(), 320);
            assert_eq!(x.output_len, 7);
            assert_eq!(x.prompt[..300], r[0].prompt[..300]);
            assert!(x.prompt.iter().all(|&t| t < 50_000));
        }
        for (i, a) in r.iter().enumerate() {
            for b in &r[i + 1..] {
                assert!(
                    common(&a.prompt, &b.prompt) < 303,
                    "questions are their own"
                );
            }
        }
    }

    #[test]
    fn multi_level_datasets_share_each_level_with_their_branch() {
        // 2 documents after 10 tokens of instructions: a request shares 10 + 40 tokens with
        // those of its document and 10 with the others.
        let s = shape("--dataset multi-doc --prefix-len 10 --groups 2 --group-len 40");
        assert_eq!((s.leaves(), s.shared_len(), s.own_len), (2, 50, 64));
        let r = s.draw(8, 1000, 2);
        let mut docs: Vec<&[u32]> = r.iter().map(|x| &x.prompt[..50]).collect();
        docs.sort();
        docs.dedup();
        assert_eq!(docs.len(), 2);
        assert!(r.iter().all(|x| x.prompt[..10] == r[0].prompt[..10]));
        assert!(common(docs[0], docs[1]) < 13);
        // Chains branching 3 ways for 2 steps of 5 tokens: 1, 3 and 9 distinct prefixes.
        let s = shape("--dataset multi-chain --prefix-len 8 --branching 3 --depth 2 --step-len 5");
        assert_eq!((s.leaves(), s.shared_len(), s.own_len), (9, 18, 16));
        let r = s.draw(27, 1000, 3);
        for (len, distinct) in [(8, 1), (13, 3), (18, 9)] {
            let mut p: Vec<&[u32]> = r.iter().map(|x| &x.prompt[..len]).collect();
            p.sort();
            p.dedup();
            assert_eq!(p.len(), distinct, "prefixes of {len} tokens");
        }
        let s = shape("--dataset system-prompt --groups 3");
        assert_eq!(s.levels, [(1, 2048), (3, 1024)]);
    }

    /// A tree of more leaves than a `usize` counts draws only its requests' paths: five
    /// requests end on leaves 0-4, so four share every step but the last and the fifth
    /// branches off one step earlier.
    #[test]
    fn a_deep_tree_draws_only_its_requests_paths() {
        let s = shape("--dataset multi-chain --prefix-len 4 --branching 4 --depth 40 --step-len 2");
        assert_eq!(s.leaves(), usize::MAX);
        let r = s.draw(5, 1000, 5);
        for (len, distinct) in [(4, 1), (80, 1), (82, 2), (84, 5)] {
            let mut p: Vec<&[u32]> = r.iter().map(|x| &x.prompt[..len]).collect();
            p.sort();
            p.dedup();
            assert_eq!(p.len(), distinct, "prefixes of {len} tokens");
        }
    }

    #[test]
    fn lengths_vary_within_the_range_and_draws_follow_the_seed() {
        let s = shape("--input-len 100 --output-len 50 --range-ratio 0.2");
        assert_eq!(s.leaves(), 1);
        let r = s.draw(200, 1000, 4);
        assert!(r.iter().all(|x| (80..=120).contains(&x.prompt.len())));
        assert!(r.iter().all(|x| (40..=60).contains(&x.output_len)));
        let lens: std::collections::BTreeSet<usize> = r.iter().map(|x| x.prompt.len()).collect();
        assert!(lens.len() > 10, "lengths vary");
        assert_eq!(r, s.draw(200, 1000, 4));
        assert_ne!(r, s.draw(200, 1000, 5));
        let fixed = shape("--input-len 100").draw(5, 1000, 4);
        assert!(fixed
            .iter()
            .all(|x| x.prompt.len() == 100 && x.output_len == 128));
    }
}
