//! A prompt's parts after its text: the API's blocks as ACP content blocks,
//! and the check that the agent takes them (its `promptCapabilities`).

use agent_client_protocol::v1::schema::{
    BlobResourceContents, ContentBlock, EmbeddedResource, EmbeddedResourceResource, ImageContent,
    PromptCapabilities, ResourceLink, TextResourceContents,
};
use base64::Engine;
use sessiond_proto::agentctl::v1::{self as pb, prompt_block::Block, prompt_resource::Contents};

use crate::error::{Error, Result};

/// The API's blocks as ACP content blocks (bytes as base64, as ACP carries
/// them). INVALID_ARGUMENT for an empty block.
pub fn from_proto(blocks: Vec<pb::PromptBlock>) -> Result<Vec<ContentBlock>> {
    let b64 = base64::engine::general_purpose::STANDARD;
    blocks
        .into_iter()
        .enumerate()
        .map(|(i, b)| match b.block {
            Some(Block::Image(img)) => {
                if img.data.is_empty() || img.mime_type.is_empty() {
                    return Err(Error::InvalidArgument(format!(
                        "blocks[{i}]: an image needs its bytes and mime_type"
                    )));
                }
                let mut c = ImageContent::new(b64.encode(&img.data), img.mime_type);
                c.uri = (!img.uri.is_empty()).then_some(img.uri);
                Ok(ContentBlock::Image(c))
            }
            Some(Block::ResourceLink(l)) => {
                if l.uri.is_empty() {
                    return Err(Error::InvalidArgument(format!(
                        "blocks[{i}]: a resource link needs its uri"
                    )));
                }
                let name = if l.name.is_empty() {
                    l.uri.clone()
                } else {
                    l.name
                };
                let mut c = ResourceLink::new(name, l.uri);
                c.mime_type = (!l.mime_type.is_empty()).then_some(l.mime_type);
                Ok(ContentBlock::ResourceLink(c))
            }
            Some(Block::Resource(r)) => {
                let mime = (!r.mime_type.is_empty()).then_some(r.mime_type);
                let resource = match r.contents {
                    Some(Contents::Text(text)) => {
                        let mut t = TextResourceContents::new(text, r.uri);
                        t.mime_type = mime;
                        EmbeddedResourceResource::TextResourceContents(t)
                    }
                    Some(Contents::Blob(bytes)) => {
                        let mut b = BlobResourceContents::new(b64.encode(bytes), r.uri);
                        b.mime_type = mime;
                        EmbeddedResourceResource::BlobResourceContents(b)
                    }
                    None => {
                        return Err(Error::InvalidArgument(format!(
                            "blocks[{i}]: a resource needs its text or bytes"
                        )));
                    }
                };
                Ok(ContentBlock::Resource(EmbeddedResource::new(resource)))
            }
            None => Err(Error::InvalidArgument(format!("blocks[{i}]: empty block"))),
        })
        .collect()
}

/// INVALID_ARGUMENT naming the capability the agent lacks for the first
/// block it cannot take. `caps` is `None` before the agent answered
/// `initialize` (then nothing but text and links is known to work).
pub fn check_capabilities(
    blocks: &[ContentBlock],
    caps: Option<&PromptCapabilities>,
) -> Result<()> {
    let none = PromptCapabilities::default();
    let caps = caps.unwrap_or(&none);
    for (i, b) in blocks.iter().enumerate() {
        let (ok, needs, what) = match b {
            ContentBlock::Image(_) => (caps.image, "image", "an image"),
            ContentBlock::Audio(_) => (caps.audio, "audio", "audio"),
            ContentBlock::Resource(_) => (
                caps.embedded_context,
                "embeddedContext",
                "an embedded resource",
            ),
            _ => (true, "", ""),
        };
        if !ok {
            return Err(Error::InvalidArgument(format!(
                "blocks[{i}]: the agent does not take {what} in a prompt (its \
                 promptCapabilities.{needs} is false)"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image() -> pb::PromptBlock {
        pb::PromptBlock {
            block: Some(Block::Image(pb::PromptImage {
                mime_type: "image/png".into(),
                data: vec![0x89, b'P', b'N', b'G'],
                uri: String::new(),
            })),
        }
    }

    #[test]
    fn blocks_become_acp_content_and_capabilities_are_checked() {
        let link = pb::PromptBlock {
            block: Some(Block::ResourceLink(pb::PromptResourceLink {
                uri: "file:///w/a.rs".into(),
                ..Default::default()
            })),
        };
        let file = pb::PromptBlock {
            block: Some(Block::Resource(pb::PromptResource {
                uri: "file:///w/a.rs".into(),
                mime_type: String::new(),
                contents: Some(Contents::Text("fn main() {}".into())),
            })),
        };
        let blocks = from_proto(vec![image(), link, file]).unwrap();
        let ContentBlock::Image(img) = &blocks[0] else {
            panic!("{blocks:?}")
        };
        assert_eq!(img.data, "iVBORw==");
        let ContentBlock::ResourceLink(l) = &blocks[1] else {
            panic!("{blocks:?}")
        };
        assert_eq!(
            l.name, "file:///w/a.rs",
            "the uri names a link without a name"
        );

        let err = check_capabilities(&blocks, None).unwrap_err().to_string();
        assert!(err.contains("promptCapabilities.image"), "{err}");
        let caps = PromptCapabilities::new().image(true);
        let err = check_capabilities(&blocks, Some(&caps))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("blocks[2]") && err.contains("embeddedContext"),
            "{err}"
        );
        let caps = caps.embedded_context(true);
        check_capabilities(&blocks, Some(&caps)).unwrap();
        check_capabilities(&blocks[1..2], None).expect("links need no capability");
    }

    #[test]
    fn an_empty_block_is_refused() {
        let err = from_proto(vec![pb::PromptBlock { block: None }]).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    }
}
