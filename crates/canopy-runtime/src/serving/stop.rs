//! A sample's text as it streams: stop strings found, and text that could still become one
//! held back until it cannot.

/// The text of one sample and how much of it has been released.
#[derive(Debug, Default)]
pub(crate) struct StopText {
    text: String,
    released: usize,
}

impl StopText {
    /// Adds `piece` to the text; returns the text now safe to release and whether a stop
    /// string ended it (the text then ends before the stop string).
    pub fn push(&mut self, piece: &str, stops: &[String]) -> (String, bool) {
        // A stop string can only end in the new piece: look from where it could start.
        let from = self.text.len().saturating_sub(longest(stops));
        self.text.push_str(piece);
        let found = stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| {
                let start = floor_char(&self.text, from);
                self.text[start..].find(s.as_str()).map(|at| start + at)
            })
            .min();
        if let Some(at) = found {
            self.text.truncate(at);
            return (self.release(self.text.len()), true);
        }
        let safe = held_back(&self.text, stops);
        (self.release(safe), false)
    }

    /// Everything not yet released (the sample ended).
    pub fn finish(&mut self) -> String {
        self.release(self.text.len())
    }

    fn release(&mut self, upto: usize) -> String {
        let out = self.text[self.released..upto.max(self.released)].to_string();
        self.released = self.released.max(upto);
        out
    }
}

fn longest(stops: &[String]) -> usize {
    stops.iter().map(String::len).max().unwrap_or(0)
}

/// The largest character boundary at or before `i`.
fn floor_char(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// How much of `text` can be released: all but a tail that is a prefix of a stop string
/// (streamed text holds that tail back until it cannot begin one).
pub fn held_back(text: &str, stops: &[String]) -> usize {
    let mut safe = text.len();
    for stop in stops {
        for (i, _) in text.char_indices().rev().take(stop.chars().count()) {
            if stop.starts_with(&text[i..]) {
                safe = safe.min(i);
            }
        }
    }
    safe
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn a_possible_stop_string_is_held_back_until_it_cannot_be_one() {
        let stops = stops(&["\nUser:"]);
        let mut t = StopText::default();
        assert_eq!(t.push("Hello", &stops), ("Hello".into(), false));
        assert_eq!(t.push("\nUs", &stops), (String::new(), false));
        assert_eq!(t.push("ually", &stops), ("\nUsually".into(), false));
        assert_eq!(t.push(" so\nUser: hi", &stops), (" so".into(), true));
        assert_eq!(t.finish(), "");
    }

    #[test]
    fn stop_strings_across_pieces_and_characters_are_found() {
        let stops = stops(&["ab", "é!"]);
        let mut t = StopText::default();
        assert_eq!(t.push("xa", &stops), ("x".into(), false));
        assert_eq!(t.push("b", &stops), (String::new(), true));
        let mut t = StopText::default();
        assert_eq!(t.push("ééé", &stops), ("éé".into(), false));
        assert_eq!(t.push("!", &stops), (String::new(), true));
        assert_eq!(t.finish(), "");
        let mut t = StopText::default();
        assert_eq!(t.push("x", &[]), ("x".into(), false));
    }
}
