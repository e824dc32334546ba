//! A client of `pdnode.v1.Inference/Generate`: streams one completion and prints it.
//!
//! ```text
//! cargo run -p pdnode-router --example grpc_client -- http://127.0.0.1:50051 "The capital of France is"
//! PDNODE_API_KEY=secret cargo run -p pdnode-router --example grpc_client -- http://127.0.0.1:50051 "Hi"
//! ```
//! The same call with grpcurl (reflection is on):
//! ```text
//! grpcurl -plaintext -d '{"text": "Hello", "sampling": {"max_tokens": 16, "temperature": 0}}' \
//!     127.0.0.1:50051 pdnode.v1.Inference/Generate
//! ```

use pdnode_proto::v1::generate_request::Prompt;
use pdnode_proto::v1::generate_response::Event;
use pdnode_proto::v1::inference_client::InferenceClient;
use pdnode_proto::v1::{GenerateRequest, SamplingParams};
use std::io::Write;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let addr = args
        .next()
        .unwrap_or_else(|| "http://127.0.0.1:50051".to_string());
    let prompt = args
        .next()
        .unwrap_or_else(|| "The capital of France is".to_string());
    let mut client = InferenceClient::connect(addr).await?;
    let mut req = tonic::Request::new(GenerateRequest {
        prompt: Some(Prompt::Text(prompt)),
        sampling: Some(SamplingParams {
            max_tokens: Some(32),
            temperature: Some(0.0),
            ..Default::default()
        }),
        client_request_id: "example-1".into(),
        ..Default::default()
    });
    if let Ok(key) = std::env::var("PDNODE_API_KEY") {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {key}").parse()?);
    }
    let mut stream = client.generate(req).await?.into_inner();
    let mut out = std::io::stdout();
    while let Some(msg) = stream.message().await? {
        match msg.event {
            Some(Event::Chunk(c)) => {
                write!(out, "{}", c.text)?;
                out.flush()?;
            }
            Some(Event::Done(d)) => {
                let u = d.usage.unwrap_or_default();
                println!(
                    "\n[finish_reason={} prompt_tokens={} completion_tokens={} request_id={}]",
                    d.finish_reason, u.prompt_tokens, u.completion_tokens, d.request_id
                );
                if let Some(e) = d.error {
                    eprintln!("error: {}", e.message);
                    std::process::exit(1);
                }
            }
            None => {}
        }
    }
    Ok(())
}
