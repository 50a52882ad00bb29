//! Session titles through the API: named by the first prompt, renamed by
//! the agent (`session_info_update`), set by SetSessionTitle, which neither
//! replaces; kept over a kill -9; bad titles and unknown sessions refused.

use sessiond_proto::sessiond::v1 as pb;

use crate::support::*;

async fn set(
    c: &mut Sessions,
    task: &str,
    session: &str,
    title: &str,
) -> Result<pb::Session, tonic::Status> {
    c.set_session_title(pb::SetSessionTitleRequest {
        task_id: task.into(),
        session_id: session.into(),
        title: title.into(),
    })
    .await
    .map(|r| r.into_inner().session.unwrap())
}

#[tokio::test]
async fn titles_come_from_the_prompt_the_agent_and_the_user() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let mut server = start(&data, &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "titles").await;
    let s = create_session(&mut c, &task.id, &work, "").await;
    assert_eq!(s.title, "");

    // The first prompt's first line, whitespace collapsed.
    prompt(
        &mut c,
        &task.id,
        &s.id,
        "\n  fix   the flaky\tbuild \nthen more",
    )
    .await;
    assert_eq!(title(&mut c, &task.id, &s.id).await, "fix the flaky build");
    prompt(&mut c, &task.id, &s.id, "a second prompt").await;
    assert_eq!(title(&mut c, &task.id, &s.id).await, "fix the flaky build");
    // The agent's title replaces the prompt's.
    prompt(&mut c, &task.id, &s.id, "/activity").await;
    assert_eq!(title(&mut c, &task.id, &s.id).await, "demo session");

    // The user's title replaces any, and the agent's does not replace it.
    let renamed = set(&mut c, &task.id, &s.id, "  Release notes  ")
        .await
        .unwrap();
    assert_eq!(renamed.title, "Release notes", "trimmed");
    prompt(&mut c, &task.id, &s.id, "/activity").await;
    let listed = list(&mut c, &task.id).await;
    assert_eq!(listed[0].title, "Release notes");

    // Refused, naming the field; nothing written.
    let bad = [
        "two\nlines",
        "bell\u{7}",
        "two\u{2028}lines",
        "gpj.\u{202E}exe",
        "\u{200B}",
        &"x".repeat(201),
    ];
    for bad in bad {
        let err = set(&mut c, &task.id, &s.id, bad).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{bad:?}: {err:?}");
        assert!(err.message().starts_with("title: "), "{}", err.message());
    }
    assert_eq!(title(&mut c, &task.id, &s.id).await, "Release notes");
    assert_eq!(
        set(&mut c, &task.id, &s.id, &"é".repeat(200))
            .await
            .unwrap()
            .title
            .chars()
            .count(),
        200
    );
    let unknown = sessiond_domain::SessionId::new().to_string();
    assert_eq!(
        code(set(&mut c, &task.id, &unknown, "x").await),
        tonic::Code::NotFound
    );
    let other = create_task(&mut c, "another").await;
    assert_eq!(
        code(set(&mut c, &other.id, &s.id, "x").await),
        tonic::Code::NotFound
    );
    assert_eq!(
        code(set(&mut c, &task.id, "not-a-uuid", "x").await),
        tonic::Code::InvalidArgument
    );

    // Cleared: the next prompt names it again; kept over a kill -9.
    assert_eq!(set(&mut c, &task.id, &s.id, "").await.unwrap().title, "");
    prompt(&mut c, &task.id, &s.id, "named again").await;
    server.kill();
    let server = start(&data, &[]);
    let mut c = sessions(&server).await;
    assert_eq!(title(&mut c, &task.id, &s.id).await, "named again");

    // sessionctl: `title` renames, `session list` shows it.
    let addr = server.addr.clone();
    let ctl = |args: &[&str]| {
        let out = std::process::Command::new(bin("sessionctl"))
            .args(["--addr", &format!("http://{addr}"), "--token", TOKEN])
            .args(args)
            .env("SESSIOND_TASK", &task.id)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    assert!(ctl(&["title", &s.id, "from the cli"]).contains("\"from the cli\""));
    assert!(ctl(&["session", "list"]).contains("from the cli"));
}
