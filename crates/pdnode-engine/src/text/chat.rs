//! Chat templates: the model's Jinja template rendered with minijinja the way HF's
//! `apply_chat_template` renders it.
//!
//! HF's environment: `trim_blocks` and `lstrip_blocks` on, the loop-controls extension, the
//! globals `raise_exception` and `strftime_now`, a `tojson` filter that is Python's
//! `json.dumps(x, ensure_ascii=False)` (spaces after `,` and `:`, no HTML escaping; `indent` and
//! `sort_keys` supported), and Python string/dict methods (`.strip()`, `.startswith()`,
//! `.items()`, ...) through minijinja-contrib's pycompat. The context holds `messages`,
//! `add_generation_prompt`, `bos_token`, `eos_token`, and optionally `tools` and any extra keys.

use super::TextError;
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

const TEMPLATE_NAME: &str = "chat";

/// Instructions one rendering may run (minijinja's fuel). Published templates (Llama 3.x,
/// Qwen2.5/QwQ/Qwen3, DeepSeek-V3.1/R1, Mistral Nemo, gpt-oss, SmolLM2) spend 60-300 plus 23-68
/// per message, with or without tools: this serves conversations of over 70,000 messages and
/// stops a runaway loop (`range(100000)` nested) in about a fifth of a second.
pub const RENDER_FUEL: u64 = 5_000_000;
/// Bytes one rendering may produce: the router's request body limit (8 MiB) with room for the
/// template's own text. A template that would write more (`"x" * 100000000` in a loop) fails.
pub const MAX_RENDER_BYTES: usize = 16 << 20;

/// One chat message in the common role/content form. Richer messages (tool calls, content parts)
/// can be passed to [`ChatTemplate::render`] as any serializable value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// Options of one rendering.
///
/// Values are minijinja values so that object key order survives: `tojson` writes keys in the
/// order the value holds them, as Python does. Deserialize request JSON straight into
/// [`TemplateValue`] (`serde_json::from_str::<TemplateValue>`) to keep the client's order;
/// `TemplateValue::from_serialize(&serde_json_value)` gives sorted keys (serde_json's default map).
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    /// Append the header that starts the assistant's turn.
    pub add_generation_prompt: bool,
    /// The `tools` variable (OpenAI tool definitions), when the request has tools.
    pub tools: Option<Value>,
    /// Further variables (e.g. `enable_thinking`); they do not override the ones above.
    pub extra: Vec<(String, Value)>,
}

/// A compiled chat template. Compile once per model; render per request.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are the strings the template sees.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TextError> {
        let mut env = Environment::new();
        env.set_fuel(Some(RENDER_FUEL));
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| TextError::TemplateSyntax {
                reason: describe(&e),
            })?;
        Ok(Self {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// Renders `messages` (anything serializable as a list of message objects: [`ChatMessage`]s,
    /// request structs, or [`TemplateValue`]s deserialized from JSON to keep key order).
    pub fn render<M: Serialize>(
        &self,
        messages: &[M],
        opts: &RenderOptions,
    ) -> Result<String, TextError> {
        let mut ctx: std::collections::BTreeMap<String, Value> =
            opts.extra.iter().cloned().collect();
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(opts.add_generation_prompt),
        );
        ctx.insert("bos_token".into(), Value::from(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Value::from(self.eos_token.clone()));
        if let Some(tools) = &opts.tools {
            ctx.insert("tools".into(), tools.clone());
        }
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TextError::TemplateSyntax {
                reason: describe(&e),
            })?;
        let mut out = CappedWriter {
            buf: Vec::new(),
            cap: MAX_RENDER_BYTES,
        };
        let render_err = |e: Error| TextError::TemplateRender {
            reason: describe(&e),
        };
        tmpl.render_captured_to(Value::from_serialize(&ctx), &mut out)
            .map_err(render_err)?;
        // minijinja writes whole strings, and the cap refuses whole writes: UTF-8 throughout.
        String::from_utf8(out.buf).map_err(|e| TextError::TemplateRender {
            reason: format!("the output is not UTF-8: {e}"),
        })
    }

    /// Renders one user message with the generation prompt (what `pdnode generate --chat` sends).
    pub fn render_user_prompt(&self, prompt: &str) -> Result<String, TextError> {
        self.render(
            &[ChatMessage::user(prompt)],
            &RenderOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        )
    }
}

/// A rendering's output, refusing any write that would take it past `cap` bytes.
struct CappedWriter {
    buf: Vec<u8>,
    cap: usize,
}

impl std::io::Write for CappedWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        if bytes.len() > self.cap - self.buf.len() {
            return Err(std::io::Error::other(format!(
                "the rendered prompt would pass {} bytes",
                self.cap
            )));
        }
        self.buf.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The error with its chain (minijinja puts the useful detail in sources).
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        let _ = write!(s, ": {inner}");
        src = inner.source();
    }
    s
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// HF's `strftime_now(format)`: the current UTC time formatted with a subset of strftime
/// (`%d %m %Y %y %b %B %a %A %H %M %S %j %%`); other directives are an error.
fn strftime_now(format: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(secs, &format).map(Value::from)
}

pub(crate) fn strftime(unix_secs: i64, format: &str) -> Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let sod = unix_secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let day = doy_mar - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const CUM: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUM[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let mname = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('d') => write!(out, "{day:02}"),
            Some('m') => write!(out, "{month:02}"),
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year.rem_euclid(100)),
            Some('b') => write!(out, "{}", &mname[..3]),
            Some('B') => write!(out, "{mname}"),
            Some('a') => write!(out, "{}", &DAYS[weekday][..3]),
            Some('A') => write!(out, "{}", DAYS[weekday]),
            Some('H') => write!(out, "{:02}", sod / 3600),
            Some('M') => write!(out, "{:02}", sod / 60 % 60),
            Some('S') => write!(out, "{:02}", sod % 60),
            Some('j') => write!(out, "{yday:03}"),
            Some('%') => write!(out, "%"),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.unwrap_or(' ')
                    ),
                ));
            }
        };
    }
    Ok(out)
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.clamp(0, 16) as usize)),
            None => Some(v.as_str().unwrap_or("").to_string()),
        },
    };
    let mut out = String::new();
    let w = JsonWriter {
        indent: indent.as_deref(),
        sort_keys: sort_keys.unwrap_or(false),
    };
    w.write(&mut out, value, 0)?;
    Ok(Value::from(out))
}

struct JsonWriter<'a> {
    indent: Option<&'a str>,
    sort_keys: bool,
}

impl JsonWriter<'_> {
    fn newline(&self, out: &mut String, depth: usize) {
        if let Some(ind) = self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    }

    fn item_sep(&self) -> &'static str {
        if self.indent.is_some() { "," } else { ", " }
    }

    fn write(&self, out: &mut String, v: &Value, depth: usize) -> Result<(), Error> {
        if depth > 128 {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: value nested too deeply",
            ));
        }
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if v.is_integer() {
                    let _ = write!(out, "{v}");
                } else {
                    let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                    if f.is_nan() {
                        out.push_str("NaN");
                    } else if f.is_infinite() {
                        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
                    } else {
                        let _ = write!(out, "{v}");
                    }
                }
            }
            ValueKind::String => write_str(out, v.as_str().unwrap_or("")),
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                if self.sort_keys {
                    keys.sort();
                }
                out.push('{');
                for (i, k) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep());
                    }
                    self.newline(out, depth + 1);
                    match k.as_str() {
                        Some(s) => write_str(out, s),
                        None => write_str(out, &k.to_string()),
                    }
                    out.push_str(": ");
                    self.write(out, &v.get_item(k)?, depth + 1)?;
                }
                self.newline(out, depth);
                out.push('}');
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep());
                    }
                    self.newline(out, depth + 1);
                    self.write(out, item, depth + 1)?;
                }
                self.newline(out, depth);
                out.push(']');
            }
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: cannot serialize a {other}"),
                ));
            }
        }
        Ok(())
    }
}

/// A JSON string as Python writes it with `ensure_ascii=False`.
fn write_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, msgs: &[ChatMessage]) -> Result<String, TextError> {
        ChatTemplate::new(src, "<s>", "</s>")?.render(msgs, &RenderOptions::default())
    }

    #[test]
    fn raise_exception_is_a_render_error_with_the_message() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}ok";
        let e = render(src, &[ChatMessage::system("x")]).unwrap_err();
        match e {
            TextError::TemplateRender { reason } => {
                assert!(reason.contains("roles must alternate"))
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(render(src, &[ChatMessage::user("x")]).unwrap(), "ok");
    }

    #[test]
    fn bad_syntax_is_a_syntax_error() {
        assert!(matches!(
            ChatTemplate::new("{% for %}", "", ""),
            Err(TextError::TemplateSyntax { .. })
        ));
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let t = ChatTemplate::new(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ y | tojson(sort_keys=true) }}",
            "",
            "",
        )
        .unwrap();
        let x = r#"{"é": "<tag> & \"q\"\n", "a": [1, 2.5, null, true]}"#;
        let extra = vec![
            ("x".to_string(), serde_json::from_str::<Value>(x).unwrap()),
            (
                "y".to_string(),
                serde_json::from_str::<Value>(r#"{"b": 1, "a": {}}"#).unwrap(),
            ),
        ];
        let out = t
            .render::<ChatMessage>(
                &[],
                &RenderOptions {
                    extra,
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(
            out,
            "{\"é\": \"<tag> & \\\"q\\\"\\n\", \"a\": [1, 2.5, null, true]}|\
             {\n  \"é\": \"<tag> & \\\"q\\\"\\n\",\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true\n  ]\n}|\
             {\"a\": {}, \"b\": 1}"
        );
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday, day 60 of a leap year.
        let t = 1_709_211_909;
        assert_eq!(
            strftime(t, "%d %b %Y %H:%M:%S %A %j %y %B %m %%").unwrap(),
            "29 Feb 2024 13:05:09 Thursday 060 24 February 02 %"
        );
        assert_eq!(strftime(0, "%Y-%m-%d %a").unwrap(), "1970-01-01 Thu");
        assert!(strftime(0, "%Q").is_err());
    }
}
