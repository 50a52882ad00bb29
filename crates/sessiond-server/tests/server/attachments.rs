//! Messages with attachments (real sessiond, agentctl and demo agent): an
//! image's bytes, an image and a file of the worktree, a link reach the
//! agent as ACP content blocks (the agent logs each to its calls.log);
//! what the agent cannot take, or what is not what it says, is refused
//! before anything is stored.

use std::path::Path;

use base64::Engine;
use sessiond_proto::sessiond::v1 as pb;
use tonic::Code;

use crate::support::*;

/// A PNG's signature and a few bytes: what the type check reads.
const PNG: &[u8] = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR-not-a-real-picture";

fn config(root: &Path) -> String {
    let config = root.join("sessiond.toml");
    let agent = bin("acp-demo-agent");
    let state = root.join("demo-state");
    std::fs::write(
        &config,
        format!(
            "[[agents]]\nname = \"pics\"\ncommand = \"{a}\"\n\
             env = {{ ACP_DEMO_STATE_DIR = \"{s}\", ACP_DEMO_PROMPT_ATTACHMENTS = \"1\" }}\n\
             [[agents]]\nname = \"plain\"\ncommand = \"{a}\"\n\
             env = {{ ACP_DEMO_STATE_DIR = \"{s}\" }}\n",
            a = agent.display(),
            s = state.display(),
        ),
    )
    .unwrap();
    config.display().to_string()
}

fn image(data: &[u8]) -> pb::Attachment {
    pb::Attachment {
        kind: Some(pb::attachment::Kind::Image(pb::ImageAttachment {
            data: data.to_vec(),
            ..Default::default()
        })),
    }
}

fn worktree_image(path: &str) -> pb::Attachment {
    pb::Attachment {
        kind: Some(pb::attachment::Kind::Image(pb::ImageAttachment {
            path: path.into(),
            ..Default::default()
        })),
    }
}

fn file(path: &str) -> pb::Attachment {
    pb::Attachment {
        kind: Some(pb::attachment::Kind::File(pb::FileAttachment {
            path: path.into(),
        })),
    }
}

fn link(uri: &str) -> pb::Attachment {
    pb::Attachment {
        kind: Some(pb::attachment::Kind::Link(pb::LinkAttachment {
            uri: uri.into(),
            name: "the spec".into(),
            ..Default::default()
        })),
    }
}

fn send(
    task: &str,
    session: &str,
    text: &str,
    attachments: Vec<pb::Attachment>,
) -> pb::SendMessageRequest {
    pb::SendMessageRequest {
        task_id: task.into(),
        session_id: session.into(),
        content: text.into(),
        attachments,
        ..Default::default()
    }
}

/// The blocks the agent logged, in order.
fn logged_blocks(root: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(root.join("demo-state/calls.log"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["method"] == "prompt_block")
        .map(|v| v["block"].clone())
        .collect()
}

async fn user_messages(c: &mut Sessions, task: &str, session: &str) -> Vec<pb::Message> {
    c.list_messages(pb::ListMessagesRequest {
        task_id: task.into(),
        session_id: session.into(),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .messages
    .into_iter()
    .filter(|m| m.role == pb::MessageRole::User as i32)
    .collect()
}

#[tokio::test]
async fn images_files_and_links_reach_the_agent_and_what_it_cannot_take_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let config = config(root);
    let server = start(&root.join("data"), &["--config", &config]);
    let mut c = sessions(&server).await;
    let work = root.join("work");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(work.join("notes.md"), "# Notes\nship it\n").unwrap();
    std::fs::write(work.join("shot.png"), PNG).unwrap();
    std::fs::write(
        work.join("fake.png"),
        "<svg xmlns='http://www.w3.org/2000/svg'/>",
    )
    .unwrap();
    let task = create_task(&mut c, "attachments").await;
    let s = create_session(&mut c, &task.id, &work, "pics").await;

    let sent = c
        .send_message(send(
            &task.id,
            &s.id,
            "look",
            vec![
                image(PNG),
                worktree_image("shot.png"),
                file("notes.md"),
                link("https://spec.example.invalid/acp"),
            ],
        ))
        .await
        .unwrap()
        .into_inner()
        .message
        .expect("started");
    let end = turn_end(&mut c, &s.id, &sent.id).await;
    assert_eq!(end.stop_reason, "end_turn", "{end:?}");

    let b64 = base64::engine::general_purpose::STANDARD.encode(PNG);
    let blocks = logged_blocks(root);
    assert_eq!(blocks.len(), 4, "{blocks:?}");
    assert_eq!(blocks[0]["type"], "image");
    assert_eq!(blocks[0]["mime_type"], "image/png");
    assert_eq!(blocks[0]["data"], b64.as_str(), "the bytes as sent");
    assert_eq!(blocks[1]["data"], b64.as_str(), "the worktree file's bytes");
    assert!(
        blocks[1]["uri"].as_str().unwrap().ends_with("/shot.png"),
        "{blocks:?}"
    );
    assert_eq!(blocks[2]["type"], "resource");
    assert_eq!(blocks[2]["text"], "# Notes\nship it\n");
    assert!(blocks[2]["uri"].as_str().unwrap().starts_with("file://"));
    assert_eq!(blocks[3]["type"], "resource_link");
    assert_eq!(blocks[3]["uri"], "https://spec.example.invalid/acp");
    assert_eq!(blocks[3]["name"], "the spec");

    // Stored with the message: listed back as sent.
    let users = user_messages(&mut c, &task.id, &s.id).await;
    assert_eq!(users.len(), 1);
    let kinds: Vec<_> = users[0]
        .attachments
        .iter()
        .map(|a| match &a.kind {
            Some(pb::attachment::Kind::Image(i)) => format!("image {} {}", i.mime_type, i.path),
            Some(pb::attachment::Kind::File(f)) => format!("file {}", f.path),
            Some(pb::attachment::Kind::Link(l)) => format!("link {}", l.uri),
            None => "none".into(),
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "image image/png ",
            "image image/png shot.png",
            "file notes.md",
            "link https://spec.example.invalid/acp"
        ]
    );

    // Bad input: each INVALID_ARGUMENT naming what is wrong; nothing stored.
    let cases: Vec<(Vec<pb::Attachment>, &str)> = vec![
        (vec![image(b"<svg/>")], "PNG, JPEG, GIF or WebP"),
        (vec![worktree_image("fake.png")], "PNG, JPEG, GIF or WebP"),
        (vec![file("missing.md")], "missing.md"),
        (vec![worktree_image("../outside.png")], "outside.png"),
        (vec![pb::Attachment { kind: None }], "empty attachment"),
        (
            vec![pb::Attachment {
                kind: Some(pb::attachment::Kind::Image(pb::ImageAttachment {
                    mime_type: "image/jpeg".into(),
                    data: PNG.to_vec(),
                    path: String::new(),
                })),
            }],
            "does not match its bytes",
        ),
        (vec![image(&vec![0x89; 6 * 1024 * 1024])], "over the limit"),
        (vec![link("not a uri")], "not an absolute URI"),
        (vec![link("https://a b/")], "percent-encoded"),
    ];
    for (attachments, says) in cases {
        let err = c
            .send_message(send(&task.id, &s.id, "bad", attachments))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{says}: {err:?}");
        assert!(err.message().contains(says), "{says}: {}", err.message());
        // agentctl's answer, not its address or the RPC library's words.
        for internal in ["unix://", "agentctl at", "The caller does not have"] {
            assert!(
                !err.message().contains(internal),
                "{says}: {}",
                err.message()
            );
        }
    }
    assert_eq!(user_messages(&mut c, &task.id, &s.id).await.len(), 1);

    // An agent without the capability: refused, naming it; nothing stored.
    let other = root.join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("notes.md"), "more").unwrap();
    let plain = create_session(&mut c, &task.id, &other, "plain").await;
    let err = c
        .send_message(send(&task.id, &plain.id, "look", vec![image(PNG)]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("promptCapabilities.image"),
        "{}",
        err.message()
    );
    let err = c
        .send_message(send(&task.id, &plain.id, "read", vec![file("notes.md")]))
        .await
        .unwrap_err();
    assert!(
        err.message().contains("promptCapabilities.embeddedContext"),
        "{}",
        err.message()
    );
    assert!(user_messages(&mut c, &task.id, &plain.id).await.is_empty());
    // A link needs no capability.
    let ok = c
        .send_message(send(
            &task.id,
            &plain.id,
            "",
            vec![link("https://x.example.invalid/")],
        ))
        .await
        .unwrap()
        .into_inner()
        .message
        .expect("started");
    turn_end(&mut c, &plain.id, &ok.id).await;
}

/// A keyed send with attachments, repeated: the same attachments answer
/// with the first message (the agent got them once); other or no
/// attachments with the same key and text are refused, storing nothing.
#[tokio::test]
async fn a_keyed_send_is_the_same_only_with_the_same_attachments() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let config = config(root);
    let server = start(&root.join("data"), &["--config", &config]);
    let mut c = sessions(&server).await;
    let work = root.join("work");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(work.join("notes.md"), "# Notes\n").unwrap();
    let task = create_task(&mut c, "keyed attachments").await;
    let s = create_session(&mut c, &task.id, &work, "pics").await;
    let keyed = |attachments: Vec<pb::Attachment>| pb::SendMessageRequest {
        request_id: "key-1".into(),
        ..send(&task.id, &s.id, "look", attachments)
    };

    let first = c
        .send_message(keyed(vec![image(PNG), file("notes.md")]))
        .await
        .unwrap()
        .into_inner()
        .message
        .expect("started");
    turn_end(&mut c, &s.id, &first.id).await;
    let again = c
        .send_message(keyed(vec![image(PNG), file("notes.md")]))
        .await
        .unwrap()
        .into_inner()
        .message
        .expect("the first message");
    assert_eq!(again.id, first.id);

    let mut other = PNG.to_vec();
    other.extend_from_slice(b"-another");
    for attachments in [
        vec![image(&other), file("notes.md")],
        vec![image(PNG)],
        Vec::new(),
        vec![file("notes.md"), image(PNG)],
    ] {
        let err = c.send_message(keyed(attachments)).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains("request_id"), "{err:?}");
    }
    assert_eq!(user_messages(&mut c, &task.id, &s.id).await.len(), 1);
    let images = logged_blocks(root)
        .iter()
        .filter(|b| b["type"] == "image")
        .count();
    assert_eq!(images, 1, "the agent got the image once");
}
