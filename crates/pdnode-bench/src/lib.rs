//! pdnode-bench: pdnode bench: a serving benchmark against any OpenAI-compatible endpoint.
