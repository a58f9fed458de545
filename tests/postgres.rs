//! The PostgreSQL store against a server of the test's own.

mod common;

use common::postgres::PgServer;

/// The harness: a private server on a free port, as an unprivileged user, crash and restart.
#[test]
fn the_harness_runs_a_private_server_that_survives_a_crash() {
    let mut pg = PgServer::start();
    pg.sql("CREATE TABLE t (v int); INSERT INTO t VALUES (7)");
    pg.crash();
    pg.start_again();
    assert_eq!(pg.sql("SELECT v FROM t"), "7");
    assert_ne!(pg.port(), 5432);
}
