//! The proxy's schema: created when missing, checked when present, in one transaction under an
//! advisory lock.
//!
//! The lock (`pg_advisory_xact_lock` on a fixed key, released by the commit) makes instances
//! that start at once against a fresh database take turns: the first creates, the others then
//! find version 1 and change nothing. Without it two `CREATE SCHEMA IF NOT EXISTS` can both see
//! no schema and one fails on the catalog's unique index.
//!
//! Each step checks before it creates, so an operator may create the schema (and grant the
//! proxy's role only what it uses in it) without giving that role `CREATE` on the database:
//! `CREATE SCHEMA IF NOT EXISTS` checks that privilege even when the schema exists.
//!
//! The table is an ordinary (logged) table, never `UNLOGGED`: an unlogged table is emptied by a
//! crash of the server, and a forgotten record is an operation run twice. It churns (every key
//! is inserted, updated a few times and deleted within its ttl), so autovacuum is told to visit
//! it after 1% of its rows changed instead of the default 20%.

use std::sync::Arc;

use super::error;
use super::pool::{Conn, Connections};
use crate::store::StoreError;

/// The version of the layout this proxy writes and reads.
pub(super) const VERSION: i32 = 1;

/// The advisory lock every instance takes while it sets the schema up (the bytes of
/// "idemprox"): fixed, so instances of every version agree on it.
const LOCK_KEY: i64 = i64::from_be_bytes(*b"idemprox");

/// What the setup concluded, once it reached the database: ready, or a refusal that no retry
/// can change (a schema of a newer version), said the same to every operation.
pub(super) type Outcome = Result<(), Arc<str>>;

/// Sets the schema up, or finds it ready. `Err`: the database could not be reached or refused a
/// step; the next operation tries again.
pub(super) async fn set_up(connections: &Connections, schema: &str) -> Result<Outcome, StoreError> {
    let mut conn = connections.get("schema").await?;
    let outcome = set_up_on(&mut conn, schema).await.map_err(|e| {
        error::backend(
            "schema",
            format!("setting up schema {schema}: {}", error::describe(&e)),
        )
    })?;
    conn.finished();
    Ok(outcome)
}

async fn set_up_on(conn: &mut Conn<'_>, schema: &str) -> Result<Outcome, tokio_postgres::Error> {
    let tx = conn.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK_KEY])
        .await?;
    let has_schema: bool = tx
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)",
            &[&schema],
        )
        .await?
        .try_get(0)?;
    if !has_schema {
        tx.batch_execute(&format!("CREATE SCHEMA {schema}")).await?;
    }
    let versions = format!("{schema}.schema_version");
    let has_versions: bool = tx
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&versions])
        .await?
        .try_get(0)?;
    if has_versions {
        let found: Option<i32> = tx
            .query_one(&format!("SELECT max(version) FROM {versions}"), &[])
            .await?
            .try_get(0)?;
        match found {
            Some(VERSION) => {
                tx.commit().await?;
                return Ok(Ok(()));
            }
            // Nothing is changed (the transaction rolls back): the newer proxy's rows stay as
            // they are, and this one serves nothing rather than misread them.
            Some(v) if v > VERSION => {
                return Ok(Err(format!(
                    "schema {schema} is at version {v}, newer than version {VERSION} that this idemproxy knows: a newer idemproxy set it up; run that version, or give this one another store.schema"
                )
                .into()));
            }
            Some(v) => {
                return Ok(Err(format!(
                    "schema {schema} says it is at version {v}, which no idemproxy writes (this one writes version {VERSION}): {versions} was changed by hand"
                )
                .into()));
            }
            // An empty version table (emptied by hand): set up again; every step below leaves
            // what exists alone.
            None => {}
        }
    } else {
        tx.batch_execute(&format!(
            "CREATE TABLE {versions} (version integer NOT NULL)"
        ))
        .await?;
    }
    tx.batch_execute(&format!(
        "CREATE TABLE IF NOT EXISTS {schema}.records (
            key text PRIMARY KEY,
            token bytea,
            value bytea NOT NULL,
            expires_at timestamptz NOT NULL
        );
        CREATE INDEX IF NOT EXISTS records_expires_at ON {schema}.records (expires_at);
        ALTER TABLE {schema}.records SET (
            autovacuum_vacuum_scale_factor = 0.01,
            autovacuum_analyze_scale_factor = 0.02
        );
        INSERT INTO {versions} (version) VALUES ({VERSION});"
    ))
    .await?;
    tx.commit().await?;
    Ok(Ok(()))
}
