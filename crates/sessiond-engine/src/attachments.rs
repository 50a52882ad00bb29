//! What a user message carries besides its text: images, links, worktree
//! files. They are resolved before the turn's intent is stored (files read
//! through agentctl, image types checked against their bytes, the agent's
//! `promptCapabilities` asked), stored whole in the user message's `data`
//! (`"attachments"`), so a turn sent again after a crash sends the same
//! bytes, and passed to agentctl as prompt blocks.

use base64::Engine;
use serde_json::{Value, json};
use sessiond_executor::AgentctlClient;
use sessiond_proto::agentctl::v1 as pb;

use crate::{Error, Result};

/// The most an image may weigh.
pub const MAX_IMAGE_BYTES: usize = 5 * 1024 * 1024;
/// The most all attachments of one message may weigh.
pub const MAX_ATTACHMENT_BYTES: usize = 10 * 1024 * 1024;

/// Image types an agent is given (the types ACP agents take).
pub const IMAGE_TYPES: &[&str] = &["image/png", "image/jpeg", "image/gif", "image/webp"];

/// Something sent with a message's text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attachment {
    /// An image: its bytes with their MIME type, or a worktree file (`path`,
    /// relative to the worktree's root; the type is read from its bytes).
    Image {
        /// One of [`IMAGE_TYPES`]; may be empty with `path`.
        mime_type: String,
        /// Its bytes; empty with `path`.
        data: Vec<u8>,
        /// A worktree file instead of `data`.
        path: Option<String>,
    },
    /// A link the agent may follow (ACP `resource_link`).
    Link {
        /// Its URI.
        uri: String,
        /// Its name (the URI when empty).
        name: String,
        /// Its MIME type, if known.
        mime_type: Option<String>,
    },
    /// A worktree file, embedded (ACP `resource`).
    File {
        /// Relative to the worktree's root.
        path: String,
        /// Its contents once read (UTF-8 text or bytes); empty as given.
        contents: Vec<u8>,
    },
}

/// The type of an image by its first bytes, if it is one ACP agents take.
pub fn sniff_image(bytes: &[u8]) -> Option<&'static str> {
    if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some("image/png")
    } else if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        Some("image/jpeg")
    } else if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        Some("image/gif")
    } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        Some("image/webp")
    } else {
        None
    }
}

/// Reads what the attachments name from the worktree (through agentctl),
/// checks image types and sizes, and that the agent takes them. Nothing is
/// stored yet: an error here leaves no trace.
pub(crate) async fn resolve(
    client: &AgentctlClient,
    attachments: Vec<Attachment>,
) -> Result<Vec<Attachment>> {
    let mut total = 0usize;
    let mut needs: Vec<(usize, &'static str)> = Vec::new();
    let mut out = Vec::with_capacity(attachments.len());
    for (i, a) in attachments.into_iter().enumerate() {
        let a = match a {
            Attachment::Image {
                mime_type,
                data,
                path,
            } => {
                let data = match &path {
                    Some(p) => read(client, i, p, MAX_IMAGE_BYTES).await?,
                    None => data,
                };
                if data.len() > MAX_IMAGE_BYTES {
                    return Err(invalid(
                        i,
                        format!(
                            "the image is {} bytes, over the limit of {MAX_IMAGE_BYTES}",
                            data.len()
                        ),
                    ));
                }
                let Some(found) = sniff_image(&data) else {
                    return Err(invalid(
                        i,
                        format!(
                            "not an image of a type agents take ({}); its bytes are no PNG, JPEG, GIF or WebP",
                            IMAGE_TYPES.join(", ")
                        ),
                    ));
                };
                if !mime_type.is_empty() && mime_type != found {
                    return Err(invalid(
                        i,
                        format!(
                            "mime_type {mime_type:?} does not match its bytes, which are {found}"
                        ),
                    ));
                }
                needs.push((i, "image"));
                total += data.len();
                Attachment::Image {
                    mime_type: found.to_owned(),
                    data,
                    path,
                }
            }
            Attachment::Link {
                uri,
                name,
                mime_type,
            } => {
                if uri.trim().is_empty() {
                    return Err(invalid(i, "a link needs its uri".into()));
                }
                if let Some(problem) = uri_problem(&uri) {
                    return Err(invalid(i, problem));
                }
                Attachment::Link {
                    uri,
                    name,
                    mime_type,
                }
            }
            Attachment::File { path, .. } => {
                let contents = read(client, i, &path, MAX_ATTACHMENT_BYTES).await?;
                needs.push((i, "embeddedContext"));
                total += contents.len();
                Attachment::File { path, contents }
            }
        };
        if total > MAX_ATTACHMENT_BYTES {
            return Err(invalid(
                i,
                format!("the attachments weigh more than {MAX_ATTACHMENT_BYTES} bytes in all"),
            ));
        }
        out.push(a);
    }
    if !needs.is_empty() {
        let caps = client.capabilities().await?.prompt;
        for (i, need) in needs {
            let ok = caps.as_ref().is_some_and(|c| match need {
                "image" => c.image,
                _ => c.embedded_context,
            });
            if !ok {
                return Err(invalid(
                    i,
                    format!(
                        "the agent does not take this in a prompt: its ACP \
                         promptCapabilities.{need} is {}",
                        if caps.is_some() {
                            "false"
                        } else {
                            "not known yet"
                        }
                    ),
                ));
            }
        }
    }
    Ok(out)
}

async fn read(client: &AgentctlClient, i: usize, path: &str, max: usize) -> Result<Vec<u8>> {
    if path.trim().is_empty() {
        return Err(invalid(i, "path: required".into()));
    }
    client
        .read_file(pb::ReadFileRequest {
            path: path.to_owned(),
            max_bytes: max as u64,
        })
        .await
        .map_err(|e| {
            invalid(
                i,
                format!("cannot read {path:?} in the worktree: {}", e.answer()),
            )
        })
}

fn invalid(i: usize, what: String) -> Error {
    Error::InvalidArgument(format!("attachments[{i}]: {what}"))
}

/// The resolved attachments as stored in the user message's `data`.
pub(crate) fn to_json(attachments: &[Attachment]) -> Value {
    let b64 = base64::engine::general_purpose::STANDARD;
    Value::Array(
        attachments
            .iter()
            .map(|a| match a {
                Attachment::Image {
                    mime_type,
                    data,
                    path,
                } => json!({"type": "image", "mime_type": mime_type, "data": b64.encode(data), "path": path}),
                Attachment::Link {
                    uri,
                    name,
                    mime_type,
                } => json!({"type": "link", "uri": uri, "name": name, "mime_type": mime_type}),
                Attachment::File { path, contents } => {
                    json!({"type": "file", "path": path, "data": b64.encode(contents)})
                }
            })
            .collect(),
    )
}

/// Whether `asked`, as a client gives them, are the attachments `stored`
/// (a user message's, read and resolved): the same kinds in the same
/// order, each the same image (its bytes, or its worktree path), link
/// (its URI) or file (its path). What a repeated send is checked by.
pub(crate) fn same_as_asked(stored: &[Attachment], asked: &[Attachment]) -> bool {
    stored.len() == asked.len()
        && stored.iter().zip(asked).all(|(s, a)| match (s, a) {
            (
                Attachment::Image {
                    data: stored_data,
                    path: stored_path,
                    ..
                },
                Attachment::Image { data, path, .. },
            ) => match path {
                Some(path) => stored_path.as_ref() == Some(path),
                None => stored_path.is_none() && stored_data == data,
            },
            (Attachment::Link { uri: stored, .. }, Attachment::Link { uri, .. }) => stored == uri,
            (Attachment::File { path: stored, .. }, Attachment::File { path, .. }) => {
                stored == path
            }
            _ => false,
        })
}

/// The attachments stored in a user message's `data`.
pub fn of_message_data(data: &str) -> Vec<Attachment> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let Ok(v) = serde_json::from_str::<Value>(data) else {
        return Vec::new();
    };
    let Some(items) = v.get("attachments").and_then(Value::as_array) else {
        return Vec::new();
    };
    let s = |a: &Value, k: &str| a.get(k).and_then(Value::as_str).map(str::to_owned);
    let bytes = |a: &Value| {
        a.get("data")
            .and_then(Value::as_str)
            .and_then(|d| b64.decode(d).ok())
            .unwrap_or_default()
    };
    items
        .iter()
        .filter_map(|a| match a.get("type")?.as_str()? {
            "image" => Some(Attachment::Image {
                mime_type: s(a, "mime_type")?,
                data: bytes(a),
                path: s(a, "path"),
            }),
            "link" => Some(Attachment::Link {
                uri: s(a, "uri")?,
                name: s(a, "name").unwrap_or_default(),
                mime_type: s(a, "mime_type"),
            }),
            "file" => Some(Attachment::File {
                path: s(a, "path")?,
                contents: bytes(a),
            }),
            _ => None,
        })
        .collect()
}

/// The prompt blocks of resolved attachments; `root`: the worktree, for
/// the `file://` URIs of its files.
pub(crate) fn blocks(attachments: &[Attachment], root: &str) -> Vec<pb::PromptBlock> {
    use pb::prompt_block::Block;
    let file_uri = |p: &str| {
        format!(
            "file://{}/{}",
            root.trim_end_matches('/'),
            p.trim_start_matches('/')
        )
    };
    attachments
        .iter()
        .map(|a| pb::PromptBlock {
            block: Some(match a {
                Attachment::Image {
                    mime_type,
                    data,
                    path,
                } => Block::Image(pb::PromptImage {
                    mime_type: mime_type.clone(),
                    data: data.clone(),
                    uri: path.as_deref().map(file_uri).unwrap_or_default(),
                }),
                Attachment::Link {
                    uri,
                    name,
                    mime_type,
                } => Block::ResourceLink(pb::PromptResourceLink {
                    uri: uri.clone(),
                    name: name.clone(),
                    mime_type: mime_type.clone().unwrap_or_default(),
                }),
                Attachment::File { path, contents } => Block::Resource(pb::PromptResource {
                    uri: file_uri(path),
                    mime_type: String::new(),
                    contents: Some(match String::from_utf8(contents.clone()) {
                        Ok(text) => pb::prompt_resource::Contents::Text(text),
                        Err(e) => pb::prompt_resource::Contents::Blob(e.into_bytes()),
                    }),
                }),
            }),
        })
        .collect()
}

/// The prompt blocks stored with a user message (a pending turn sent
/// again after a crash carries the same bytes).
pub(crate) fn stored_blocks(data: &str, root: &str) -> Vec<pb::PromptBlock> {
    blocks(&of_message_data(data), root)
}

/// Why `uri` is no absolute URI an agent could follow (RFC 3986: a
/// scheme, a colon, then no spaces or control characters), if it is not.
fn uri_problem(uri: &str) -> Option<String> {
    let scheme = uri.split_once(':').map(|(s, _)| s).unwrap_or_default();
    let scheme_ok = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    if !scheme_ok {
        return Some(format!(
            "link {uri:?} is not an absolute URI: it needs a scheme, as in https://example.com/page or file:///path"
        ));
    }
    if uri.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Some(format!(
            "link {uri:?} is not a URI: spaces and control characters must be percent-encoded"
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_link_must_be_an_absolute_uri() {
        for good in [
            "https://example.com/a?b=c#d",
            "file:///tmp/x",
            "mailto:a@b",
            "urn:isbn:1",
        ] {
            assert_eq!(super::uri_problem(good), None, "{good}");
        }
        for bad in [
            "not a uri",
            "example.com/page",
            "/tmp/x",
            ":x",
            "1http://x",
            "https://a b/",
            "http://x/\n",
        ] {
            assert!(super::uri_problem(bad).is_some(), "{bad}");
        }
    }

    use super::*;

    #[test]
    fn a_repeated_send_is_compared_by_its_attachments_as_given() {
        let image = |data: &[u8]| Attachment::Image {
            mime_type: String::new(),
            data: data.to_vec(),
            path: None,
        };
        let file = |path: &str, contents: &[u8]| Attachment::File {
            path: path.into(),
            contents: contents.to_vec(),
        };
        let link = |uri: &str| Attachment::Link {
            uri: uri.into(),
            name: String::new(),
            mime_type: None,
        };
        // Stored: read and resolved, then kept in the message's data.
        let stored = vec![
            image(b"png-1"),
            file("a.rs", b"fn main() {}"),
            link("https://x/"),
        ];
        let kept = of_message_data(&json!({"attachments": to_json(&stored)}).to_string());
        let asked = vec![image(b"png-1"), file("a.rs", b""), link("https://x/")];
        assert!(same_as_asked(&kept, &asked));
        assert!(!same_as_asked(&kept, &asked[..2]), "one fewer");
        assert!(!same_as_asked(
            &kept,
            &[image(b"png-2"), asked[1].clone(), asked[2].clone()]
        ));
        assert!(!same_as_asked(
            &kept,
            &[asked[0].clone(), file("b.rs", b""), asked[2].clone()]
        ));
        assert!(!same_as_asked(
            &kept,
            &[asked[1].clone(), asked[0].clone(), asked[2].clone()]
        ));
        assert!(same_as_asked(&[], &[]));
        // A worktree image is the same by its path.
        let by_path = |p: &str| Attachment::Image {
            mime_type: String::new(),
            data: Vec::new(),
            path: Some(p.into()),
        };
        let read = vec![Attachment::Image {
            mime_type: "image/png".into(),
            data: b"png-1".to_vec(),
            path: Some("pic.png".into()),
        }];
        assert!(same_as_asked(&read, &[by_path("pic.png")]));
        assert!(!same_as_asked(&read, &[by_path("other.png")]));
        assert!(
            !same_as_asked(&read, &[image(b"png-1")]),
            "bytes, not the file"
        );
    }

    #[test]
    fn image_types_are_read_from_their_bytes() {
        assert_eq!(sniff_image(b"\x89PNG\r\n\x1a\n...."), Some("image/png"));
        assert_eq!(sniff_image(&[0xFF, 0xD8, 0xFF, 0xE0]), Some("image/jpeg"));
        assert_eq!(sniff_image(b"GIF89a.."), Some("image/gif"));
        assert_eq!(sniff_image(b"RIFF\0\0\0\0WEBPVP8 "), Some("image/webp"));
        assert_eq!(sniff_image(b"<svg xmlns="), None);
        assert_eq!(sniff_image(b""), None);
    }

    #[test]
    fn stored_attachments_come_back_whole() {
        let all = vec![
            Attachment::Image {
                mime_type: "image/png".into(),
                data: b"\x89PNG\r\n\x1a\nbytes".to_vec(),
                path: Some("shot.png".into()),
            },
            Attachment::Link {
                uri: "https://example.invalid/doc".into(),
                name: "doc".into(),
                mime_type: None,
            },
            Attachment::File {
                path: "src/a.rs".into(),
                contents: b"fn main() {}".to_vec(),
            },
        ];
        let data = json!({"attachments": to_json(&all), "usage": {"inputTokens": 1}}).to_string();
        assert_eq!(of_message_data(&data), all);
        let blocks = stored_blocks(&data, "/w/");
        assert_eq!(blocks.len(), 3);
        let Some(pb::prompt_block::Block::Resource(r)) = &blocks[2].block else {
            panic!("{blocks:?}")
        };
        assert_eq!(r.uri, "file:///w/src/a.rs");
        assert_eq!(
            r.contents,
            Some(pb::prompt_resource::Contents::Text("fn main() {}".into()))
        );
        assert!(of_message_data("").is_empty());
        assert!(of_message_data("{\"usage\":{}}").is_empty());
    }
}
