//! [`TextStream`]: generated ids to text pieces, decoded incrementally.

use candle_core::Result;

use super::ModelText;

/// The longest stop string, in bytes, a [`TextStream`] takes (the server refuses longer ones
/// with a 400): the text held back and scanned per token is bounded by it.
pub const MAX_STOP_BYTES: usize = 256;

/// Tokens decoded before the text is given out even though it still ends in an incomplete
/// UTF-8 character (a model that keeps emitting stray bytes): bounds the ids decoded per token.
const MAX_PENDING_IDS: usize = 8;

/// Generated ids to text pieces: each [`TextStream::push`] returns the text that became
/// final, holding back an incomplete UTF-8 character and anything that could still turn into
/// one of the stop strings; [`TextStream::finish`] returns the rest.
///
/// Decoding is incremental, as Hugging Face's text-generation-inference does it: a token's
/// piece is the difference between the decodings of a short window of ids (from the last
/// piece's first token) with and without the new ones, so a token costs a decode of a few ids
/// whatever the length of the text (re-decoding every id per token would be quadratic), and
/// the tokenizer's decoders see enough context (a SentencePiece word-start space, a
/// character split over byte tokens). Stop strings are searched in the held-back tail and the
/// new piece only (at most [`MAX_STOP_BYTES`] plus the piece). The pieces joined are the
/// tokenizer's decoding of all the ids (special tokens left out), up to the stop string.
#[derive(Debug, Clone)]
pub struct TextStream {
    ids: Vec<u32>,
    /// The window's first id: the ids before it are text given out.
    prefix: usize,
    /// The ids before it are decoded into the held or given-out text.
    read: usize,
    /// Decoded text not given out yet: a suffix that may start a stop string.
    held: String,
    stops: Vec<String>,
    /// Set when a stop string was found: the text ends before it.
    stopped: bool,
    /// Ids decoded so far, all calls together (the cost the tests bound).
    decoded: usize,
    /// Tokens before which no stop string ends the text (vLLM's `min_tokens`).
    min_tokens: usize,
}

impl TextStream {
    /// A stream that ends at the first of `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            held: String::new(),
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            stopped: false,
            decoded: 0,
            min_tokens: 0,
        }
    }

    /// The same stream, whose stop strings act only from the `min_tokens`-th token on (as
    /// vLLM's `min_tokens`, which holds back the stop ids and the stop strings alike): the
    /// text of the tokens before it is given out whole, stop string or not.
    pub fn with_min_tokens(mut self, min_tokens: usize) -> Self {
        self.min_tokens = min_tokens;
        self
    }

    /// Whether a stop string was found (the caller ends the sequence).
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Tokens pushed.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether no token was pushed.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Adds a generated token and returns the text that became final.
    pub fn push(&mut self, text: &ModelText, id: u32) -> Result<String> {
        if self.stopped {
            return Ok(String::new());
        }
        self.ids.push(id);
        let piece = self.next_piece(text, false)?;
        if piece.is_empty() {
            return Ok(String::new());
        }
        self.held.push_str(&piece);
        if self.ids.len() < self.min_tokens {
            return Ok(std::mem::take(&mut self.held));
        }
        if let Some(out) = self.cut_at_stop() {
            return Ok(out);
        }
        // Hold back the longest suffix that is the start of a stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| s.char_indices().skip(1).map(move |(i, _)| &s[..i]))
            .filter(|p| self.held.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let tail = self.held.split_off(self.held.len() - keep);
        Ok(std::mem::replace(&mut self.held, tail))
    }

    /// The text held back, at the end of the sequence (up to a stop string completed by it).
    pub fn finish(&mut self, text: &ModelText) -> Result<String> {
        if self.stopped {
            return Ok(String::new());
        }
        let piece = self.next_piece(text, true)?;
        self.held.push_str(&piece);
        if let Some(out) = self.cut_at_stop() {
            return Ok(out);
        }
        Ok(std::mem::take(&mut self.held))
    }

    /// When the held text holds a stop string: the text before it (the stream stops).
    fn cut_at_stop(&mut self) -> Option<String> {
        let end = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()?;
        self.stopped = true;
        self.held.truncate(end);
        Some(std::mem::take(&mut self.held))
    }

    /// The text the ids since `read` add (text-generation-inference's `decode_token`): empty
    /// while it ends in an incomplete character, unless `flush` or too many ids wait.
    fn next_piece(&mut self, text: &ModelText, flush: bool) -> Result<String> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let before = text.decode(&self.ids[self.prefix..self.read])?;
        let now = text.decode(&self.ids[self.prefix..])?;
        self.decoded += self.ids.len() - self.prefix + self.read - self.prefix;
        let waiting = self.ids.len() - self.read;
        if !flush && now.ends_with('\u{FFFD}') && waiting < MAX_PENDING_IDS {
            return Ok(String::new()); // an incomplete UTF-8 sequence: wait for the next token
        }
        let piece = match now.get(before.len()..) {
            Some(p) if now.starts_with(&before) => p.to_string(),
            // The decoders rewrote the window's start (rare): give out what is new by length.
            _ => now
                .char_indices()
                .map(|(i, _)| i)
                .find(|&i| i >= before.len())
                .map_or(String::new(), |i| now[i..].to_string()),
        };
        if piece.is_empty() && !flush && waiting < MAX_PENDING_IDS {
            return Ok(String::new()); // a token without text (a skipped special token)
        }
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(piece)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smollm2() -> ModelText {
        let (_, dir) = crate::text::tests::checkpoint_with_tokenizer();
        ModelText::load(dir.path()).unwrap()
    }

    const TEXTS: [&str; 5] = [
        "Tensor parallelism splits each layer's weights across ranks.",
        "Unicode: naïve café, 東京は日本の首都です, emoji 🦀🚀 and a ZWJ family 👨‍👩‍👧.",
        "Code:\n    fn main() {\n        println!(\"{}\", 1 + 2);\n    }\n\n\tTabs\tand  double  spaces.",
        "<|im_start|>user\nspecial tokens are left out<|im_end|> of the text",
        "Ω≈ç√∫˜µ≤≥÷ åß∂ƒ©˙∆˚¬… œ∑´®†¥¨ˆøπ“‘ ¡™£¢∞§¶•ªº–≠",
    ];

    /// Every id pushed, then finish: the pieces joined.
    fn stream_all(text: &ModelText, ids: &[u32], stops: &[&str]) -> (String, TextStream) {
        stream_all_min(text, ids, stops, 0)
    }

    /// [`stream_all`] with stop strings acting from the `min_tokens`-th token on.
    fn stream_all_min(
        text: &ModelText,
        ids: &[u32],
        stops: &[&str],
        min_tokens: usize,
    ) -> (String, TextStream) {
        let mut s = TextStream::new(stops.iter().map(|s| s.to_string()).collect())
            .with_min_tokens(min_tokens);
        let mut out = String::new();
        for &id in ids {
            out.push_str(&s.push(text, id).unwrap());
            if s.stopped() {
                return (out, s);
            }
        }
        out.push_str(&s.finish(text).unwrap());
        (out, s)
    }

    /// The pieces joined are the tokenizer's decoding of all the ids (the reference: one
    /// `Tokenizer::decode` of the whole sequence), also for characters split over several
    /// byte tokens and for random ids.
    #[test]
    fn pieces_join_to_the_whole_decoding() {
        let text = smollm2();
        let mut cases: Vec<Vec<u32>> = TEXTS
            .iter()
            .map(|t| text.encode(t, false).unwrap())
            .collect();
        // Random ids (a fixed LCG), kept where the whole decoding is valid UTF-8.
        let vocab = text.tokenizer().get_vocab_size(true) as u64;
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..200 {
            let ids: Vec<u32> = (0..40)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((x >> 33) % vocab) as u32
                })
                .collect();
            if !text.decode(&ids).unwrap().contains('\u{FFFD}') {
                cases.push(ids);
            }
        }
        assert!(cases.len() > 100, "{} cases", cases.len());
        for ids in &cases {
            let whole = text.decode(ids).unwrap();
            assert!(!whole.is_empty());
            let (joined, _) = stream_all(&text, ids, &[]);
            assert_eq!(joined, whole, "ids {ids:?}");
        }
        // A character split over byte tokens is given out whole, never as U+FFFD.
        let ids = text.encode("🦀", false).unwrap();
        assert!(ids.len() > 1, "{ids:?}");
        let mut s = TextStream::new(Vec::new());
        let pieces: Vec<String> = ids.iter().map(|&id| s.push(&text, id).unwrap()).collect();
        assert_eq!(pieces.concat(), "🦀");
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
    }

    /// A token costs a decode of a bounded number of ids: 4000 tokens decode fewer than
    /// 10 ids per token in all (re-decoding the whole text per token: 8 million).
    #[test]
    fn decoding_is_incremental() {
        let text = smollm2();
        let ids = text.encode(&TEXTS.join(" ").repeat(40), false).unwrap();
        assert!(ids.len() > 3000, "{}", ids.len());
        let (joined, s) = stream_all(&text, &ids, &["no such stop string"]);
        assert_eq!(joined, text.decode(&ids).unwrap());
        assert!(
            s.decoded < 10 * ids.len(),
            "{} ids decoded for {} tokens",
            s.decoded,
            ids.len()
        );
    }

    /// Stop strings: the text ends before the first one found, also when it spans tokens or
    /// comes at the very end; text that might start one is held back, then given out.
    #[test]
    fn stop_strings() {
        let text = smollm2();
        let ids = text.encode(TEXTS[0], false).unwrap();
        let (out, s) = stream_all(&text, &ids, &["weights", "ranks"]);
        assert!(s.stopped());
        assert_eq!(out, "Tensor parallelism splits each layer's ");
        let (out, s) = stream_all(&text, &ids, &["ranks."]);
        assert!(s.stopped());
        assert_eq!(
            out,
            "Tensor parallelism splits each layer's weights across "
        );
        // "ranks.!" never comes: its start is held back, then given out at the end.
        let (out, s) = stream_all(&text, &ids, &["ranks.!"]);
        assert!(!s.stopped());
        assert_eq!(out, TEXTS[0]);
    }

    /// Stop strings wait for `min_tokens` (issue 44, defect 14): a stop string completed by a
    /// token before the `min_tokens`-th is text like any other; the next occurrence, or one
    /// completed by a later token, stops the stream.
    #[test]
    fn stop_strings_wait_for_min_tokens() {
        let text = smollm2();
        let ids = text.encode("one two one two one two", false).unwrap();
        // The token that completes the first " two" (the text grows past it there).
        let first = (1..=ids.len())
            .find(|&n| text.decode(&ids[..n]).unwrap().contains("one two"))
            .unwrap();
        let (out, s) = stream_all_min(&text, &ids, &["two"], 0);
        assert!(s.stopped());
        assert_eq!(out, "one ");
        let (out, s) = stream_all_min(&text, &ids, &["two"], first + 1);
        assert!(s.stopped());
        assert_eq!(out, "one two one ");
        let (out, s) = stream_all_min(&text, &ids, &["two"], first);
        assert!(s.stopped(), "the min_tokens-th token's stop string counts");
        assert_eq!(out, "one ");
        let (out, s) = stream_all_min(&text, &ids, &["two"], ids.len() + 1);
        assert!(!s.stopped());
        assert_eq!(out, "one two one two one two");
    }
}
