//! Two proxy instances on one Redis or PostgreSQL: a storm of retried tool calls, each retry a
//! new call with a new id through either instance, runs each booking once.

use std::time::Duration;

use harness::{Backend, Env};
use serde_json::json;

use crate::support::{McpServer, book, mcp_client, text, yaml};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_redis_run_each_call_once() {
    storm(Backend::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_postgres_run_each_call_once() {
    storm(Backend::Postgres).await;
}

async fn storm(backend: Backend) {
    let env = Env::new(backend).await;
    let server = McpServer::start().await;
    let config = yaml(&env, &server, "");
    let a = env.proxy(&config).await;
    let b = env.proxy(&config).await;
    let urls = [a.url("/mcp"), b.url("/mcp")];
    const REFERENCES: usize = 4;
    const AGENTS: usize = 6;
    let mut tasks = Vec::new();
    for agent in 0..AGENTS {
        let url = urls[agent % 2].clone();
        tasks.push(tokio::spawn(async move {
            let client = mcp_client(&url).await;
            let mut results = Vec::new();
            for r in 0..REFERENCES {
                let params = book(
                    json!({"reference": format!("R-storm-{r}"), "slow": r == 0}),
                    &format!("key-storm-{r}"),
                    json!({}),
                );
                // Retried on "in flight" as an application would, a bounded number of times.
                let mut outcome = None;
                for _ in 0..60 {
                    match client.call_tool(params.clone()).await {
                        Ok(result) => {
                            outcome = Some(text(&result));
                            break;
                        }
                        Err(rmcp::ServiceError::McpError(e)) if e.code.0 == -32091 => {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        Err(e) => panic!("agent {agent}, reference {r}: {e:?}"),
                    }
                }
                results.push(outcome.unwrap_or_else(|| panic!("agent {agent}: still in flight")));
            }
            results
        }));
    }
    for task in tasks {
        let results = task.await.expect("an agent");
        for (r, text) in results.iter().enumerate() {
            assert_eq!(
                text,
                &format!("booked R-storm-{r} #1"),
                "every agent gets the one result"
            );
        }
    }
    for r in 0..REFERENCES {
        assert_eq!(
            server.seen.bookings(&format!("R-storm-{r}")),
            1,
            "R-storm-{r} ran once"
        );
    }
}
