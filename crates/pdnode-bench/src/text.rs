//! Synthetic prompt text: common English words, each usually one BPE token with its leading space,
//! so `n` words make a prompt of roughly `n` tokens. The server's `usage.prompt_tokens` (when
//! reported) gives the exact count.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "had",
    "they",
    "you",
    "were",
    "their",
    "one",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "time",
    "people",
    "year",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "name",
    "team",
    "minute",
    "idea",
    "kid",
    "body",
    "back",
    "parent",
    "face",
    "level",
    "office",
    "door",
    "health",
    "person",
    "art",
    "war",
    "history",
    "party",
    "result",
    "change",
    "morning",
    "reason",
    "research",
    "girl",
    "guy",
    "moment",
    "air",
    "teacher",
    "force",
    "education",
    "good",
    "new",
    "first",
    "last",
    "long",
    "great",
    "little",
    "own",
    "other",
    "old",
    "big",
    "high",
    "small",
];

/// `n` words drawn with `rng`, space-separated.
pub fn words(rng: &mut impl Rng, n: usize) -> String {
    let mut s = String::with_capacity(n * 6);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    s
}

/// `n` words that depend only on `key`: equal keys give equal text (shared prefixes, trace
/// blocks with the same hash id).
pub fn keyed_words(key: u64, n: usize) -> String {
    let mut rng = ChaCha8Rng::seed_from_u64(key ^ 0x9e37_79b9_7f4a_7c15);
    words(&mut rng, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_counts_and_determinism() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let s = words(&mut rng, 100);
        assert_eq!(s.split(' ').count(), 100);
        assert_eq!(keyed_words(7, 50), keyed_words(7, 50));
        assert_ne!(keyed_words(7, 50), keyed_words(8, 50));
        assert_eq!(words(&mut rng, 0), "");
    }
}
