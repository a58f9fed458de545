//! The proxy's schema: created when missing, checked when present, in one transaction under an
//! advisory lock.
//!
//! The lock (`pg_advisory_xact_lock` on a fixed key, released by the commit) makes instances
//! that start at once against a fresh database take turns: the first creates, the others then
//! find the version set up and change nothing. Without it two `CREATE SCHEMA IF NOT EXISTS` can both see
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
//!
//! Versions: 1, and 2 (the `times` column: see [`VERSION`]). A rolling upgrade from 1: start
//! instances of this proxy one by one (each adds the column if missing and keeps writing what
//! version 1 reads), then, once none of version 1 is left, run `idemproxy store upgrade`
//! (records version 2, [`upgrade`]). The operations guide says the same for operators.

use std::sync::Arc;

use super::error;
use super::pool::{Conn, Connections};
use crate::store::StoreError;

/// The version of the layout this proxy sets up on a fresh schema, and that `idemproxy store
/// upgrade` records once every instance runs a proxy that knows it. Version 2 added the
/// nullable `times` column (a renewal writes a resolvable claim's times there, not into its
/// value); this proxy also serves a version 1 schema (adding the column, which version 1
/// proxies ignore) and then writes the times into both, so that instances of both versions
/// serve side by side during a rolling upgrade.
pub(super) const VERSION: i32 = 2;
/// The oldest version this proxy serves.
const OLDEST: i32 = 1;

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
            Some(OLDEST) => {
                add_times(&tx, schema).await?;
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
            expires_at timestamptz NOT NULL,
            times bytea
        );
        CREATE INDEX IF NOT EXISTS records_expires_at ON {schema}.records (expires_at);
        ALTER TABLE {schema}.records SET (
            autovacuum_vacuum_scale_factor = 0.01,
            autovacuum_analyze_scale_factor = 0.02
        );
        "
    ))
    .await?;
    // A table left by a version 1 proxy under a version table emptied by hand lacks it.
    add_times(&tx, schema).await?;
    tx.batch_execute(&format!(
        "INSERT INTO {versions} (version) VALUES ({VERSION})"
    ))
    .await?;
    tx.commit().await?;
    Ok(Ok(()))
}

/// Adds the `times` column to a version 1 table, when it lacks it, leaving the version at 1.
/// Version 1 proxies name their columns, so the column changes nothing for them. Checked first,
/// so that a role without ownership of the table serves a table an operator already altered.
/// The `ALTER` waits for the table's lock at most [`ALTER_LOCK_TIMEOUT`]: queued behind a long
/// transaction it would block every request's statement on the table meanwhile.
async fn add_times(
    tx: &tokio_postgres::Transaction<'_>,
    schema: &str,
) -> Result<(), tokio_postgres::Error> {
    let has_times: bool = tx
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM information_schema.columns
                WHERE table_schema = $1 AND table_name = 'records' AND column_name = 'times')",
            &[&schema],
        )
        .await?
        .try_get(0)?;
    if !has_times {
        tx.batch_execute(&format!(
            "SET LOCAL lock_timeout = '{ALTER_LOCK_TIMEOUT}';
             ALTER TABLE {schema}.records ADD COLUMN IF NOT EXISTS times bytea"
        ))
        .await?;
    }
    Ok(())
}

/// How long adding the `times` column waits for the table's lock.
const ALTER_LOCK_TIMEOUT: &str = "5s";

/// Records version 2 in a version 1 schema (adding the column first if it lacks it): from the
/// next renewal on, no instance writes a resolvable claim's times into its value, and a
/// version 1 proxy refuses to start on the schema. Run once every instance runs a proxy that
/// knows version 2. What it found and did, in a sentence.
pub(super) async fn upgrade(
    connections: &Connections,
    schema: &str,
) -> Result<Result<String, String>, StoreError> {
    let describe = |e: tokio_postgres::Error| {
        error::backend(
            "schema",
            format!("upgrading schema {schema}: {}", error::describe(&e)),
        )
    };
    if let Err(refused) = set_up(connections, schema).await? {
        return Ok(Err(refused.to_string()));
    }
    let mut conn = connections.get("schema").await?;
    let tx = conn.transaction().await.map_err(describe)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK_KEY])
        .await
        .map_err(describe)?;
    let versions = format!("{schema}.schema_version");
    let found: Option<i32> = tx
        .query_one(&format!("SELECT max(version) FROM {versions}"), &[])
        .await
        .and_then(|row| row.try_get(0))
        .map_err(describe)?;
    let said = if found == Some(VERSION) {
        format!("schema {schema} is at version {VERSION} already: nothing to do")
    } else {
        add_times(&tx, schema).await.map_err(describe)?;
        tx.execute(
            &format!("INSERT INTO {versions} (version) VALUES ({VERSION})"),
            &[],
        )
        .await
        .map_err(describe)?;
        format!("schema {schema} upgraded from version {OLDEST} to version {VERSION}")
    };
    tx.commit().await.map_err(describe)?;
    conn.finished();
    Ok(Ok(said))
}
