//! A Redis Cluster of this test's own: `redis-server` processes in cluster mode on free
//! loopback ports, joined by `redis-cli --cluster create`, killed on drop. Helpers move a slot
//! from one primary to another (the `SETSLOT`/`MIGRATE` dance, with a hook between the steps)
//! and run a coordinated failover. [`RedisCluster::single_node`] is the cheap one the behaviour
//! tests take each: one node serving every slot, taken ready from a pool.
//!
//! Why a pool: a fresh primary says `cluster_state:ok` no sooner than 2s after it starts (Redis
//! holds a new primary back that long, `CLUSTER_WRITABLE_DELAY`, so a rebooted node does not
//! take writes before the cluster could reconfigure it), and, once it has its slots, not before
//! its rejoin delay (`cluster-node-timeout`, at least 500ms) has passed. That is seconds of
//! idle waiting per test, times every behaviour test. So each test binary keeps
//! [`SPARE_NODES`] nodes starting ahead of need, slots assigned; a test takes the oldest, which
//! is ready by then, and starts its replacement.

use std::collections::{HashSet, VecDeque};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::free_port;

/// The `cluster-node-timeout` of the multi-node clusters: failure detection and failover
/// tests need one that a loaded machine does not trip by accident.
const NODE_TIMEOUT_MS: u32 = 2000;

/// The `cluster-node-timeout` of a single node: nobody is there to detect its failure, and it
/// is its rejoin delay once it has its slots (Redis clamps it to 500ms at least).
const SINGLE_NODE_TIMEOUT_MS: u32 = 500;

/// Single nodes each test binary keeps starting ahead of need ([`RedisCluster::single_node`]).
const SPARE_NODES: usize = 8;

/// The spare single nodes, oldest first. A `static` is never dropped: each spare has a
/// watchdog that kills it once the test binary is gone ([`reap_on_exit`]).
static SPARES: Mutex<VecDeque<RedisCluster>> = Mutex::new(VecDeque::new());

/// The `redis-cli` binary: `REDIS_CLI` or the one on PATH.
fn cli_binary() -> String {
    std::env::var("REDIS_CLI").unwrap_or_else(|_| "redis-cli".to_owned())
}

/// `n` distinct ports that were free a moment ago.
pub fn free_ports(n: usize) -> Vec<u16> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    while out.len() < n {
        let p = free_port();
        if seen.insert(p) {
            out.push(p);
        }
    }
    out
}

/// Polls `cond` every 20ms until it holds or `within` passes; panics with `what` otherwise.
pub fn wait_for(within: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One node of the cluster.
pub struct ClusterNode {
    /// Its client port.
    pub port: u16,
    bus: u16,
    child: Option<Child>,
}

/// A Redis Cluster on loopback.
pub struct RedisCluster {
    /// Every node, primaries and replicas.
    pub nodes: Vec<ClusterNode>,
    dir: tempfile::TempDir,
    /// Its nodes' `cluster-node-timeout`, kept for a restart.
    node_timeout_ms: u32,
}

/// One line of `CLUSTER NODES`, as far as the tests need it.
#[derive(Debug, Clone)]
pub struct NodeLine {
    /// The node's id.
    pub id: String,
    /// Its client port.
    pub port: u16,
    /// Whether it is a primary (and not failed).
    pub master: bool,
    /// The id of its primary, for a replica.
    pub master_id: Option<String>,
    /// The slots it serves, as inclusive ranges.
    pub slots: Vec<(u16, u16)>,
}

impl RedisCluster {
    /// Starts `masters` primaries with `replicas` replicas each, and waits until every node
    /// says `cluster_state:ok` and every replica is in sync.
    pub fn start(masters: usize, replicas: usize) -> RedisCluster {
        let count = masters * (1 + replicas);
        let ports = free_ports(count * 2);
        let dir = tempfile::tempdir().expect("temp dir for the cluster");
        let mut nodes: Vec<ClusterNode> = (0..count)
            .map(|i| ClusterNode {
                port: ports[2 * i],
                bus: ports[2 * i + 1],
                child: None,
            })
            .collect();
        for node in &mut nodes {
            node.child = Some(spawn_node(dir.path(), node.port, node.bus, NODE_TIMEOUT_MS));
        }
        let cluster = RedisCluster {
            nodes,
            dir,
            node_timeout_ms: NODE_TIMEOUT_MS,
        };
        for node in &cluster.nodes {
            let port = node.port;
            wait_for(Duration::from_secs(10), "a cluster node to start", || {
                ping(port)
            });
        }
        let mut create = Command::new(cli_binary());
        create.args(["--cluster", "create"]);
        for node in &cluster.nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        let out = create
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        cluster.wait_converged();
        cluster
    }

    /// One primary that serves every slot itself: one process, cheap enough for one per test,
    /// and still a real cluster to the client, which reads the slot map and routes every
    /// command by slot. Taken from this binary's spares (see the module's docs), so it is
    /// usually ready at once; waits until it says `cluster_state:ok`.
    pub fn single_node() -> RedisCluster {
        let taken = RedisCluster::spares().pop_front();
        let cluster = taken.expect("a spare single node");
        cluster.wait_converged();
        cluster
    }

    /// Starts spare single nodes until the pool is full, ahead of a first
    /// [`RedisCluster::single_node`] (`every_store!` does it in the background).
    pub fn start_spares() {
        drop(RedisCluster::spares());
    }

    /// The pool of spare single nodes, full and locked: the caller may take one.
    fn spares() -> MutexGuard<'static, VecDeque<RedisCluster>> {
        let mut spares = SPARES.lock().unwrap_or_else(PoisonError::into_inner);
        while spares.len() <= SPARE_NODES {
            spares.push_back(RedisCluster::start_single_node());
        }
        spares
    }

    /// Starts a node and gives it every slot (`CLUSTER ADDSLOTSRANGE 0 16383`, no `redis-cli
    /// --cluster create`); it says `cluster_state:ok` by itself a little later.
    fn start_single_node() -> RedisCluster {
        let ports = free_ports(2);
        let dir = tempfile::tempdir().expect("temp dir for the cluster node");
        let (port, bus) = (ports[0], ports[1]);
        // The watchdog first: a binary that exits between the spawn and the watchdog would
        // leave the node running.
        reap_on_exit(port, dir.path());
        let child = spawn_node(dir.path(), port, bus, SINGLE_NODE_TIMEOUT_MS);
        let cluster = RedisCluster {
            nodes: vec![ClusterNode {
                port,
                bus,
                child: Some(child),
            }],
            dir,
            node_timeout_ms: SINGLE_NODE_TIMEOUT_MS,
        };
        wait_for(Duration::from_secs(10), "a cluster node to start", || {
            ping(port)
        });
        let _: () = redis::cmd("CLUSTER")
            .arg("ADDSLOTSRANGE")
            .arg(0)
            .arg(16383)
            .query(&mut cluster.conn(port))
            .expect("CLUSTER ADDSLOTSRANGE 0 16383");
        cluster
    }

    /// Waits until every node says `cluster_state:ok`, knows every other, agrees on who serves
    /// every slot, and every replica's link to its primary is up.
    pub fn wait_converged(&self) {
        wait_for(Duration::from_secs(20), "the cluster to converge", || {
            self.converged()
        });
    }

    fn converged(&self) -> bool {
        let mut views = Vec::new();
        for node in &self.nodes {
            let Ok(mut c) = try_conn(node.port) else {
                return false;
            };
            let Ok(info) = redis::cmd("CLUSTER").arg("INFO").query::<String>(&mut c) else {
                return false;
            };
            if !info.contains("cluster_state:ok")
                || !info.contains(&format!("cluster_known_nodes:{}", self.nodes.len()))
            {
                return false;
            }
            let Ok(repl) = redis::cmd("INFO")
                .arg("replication")
                .query::<String>(&mut c)
            else {
                return false;
            };
            if repl.contains("role:slave") && !repl.contains("master_link_status:up") {
                return false;
            }
            let Ok(text) = redis::cmd("CLUSTER").arg("NODES").query::<String>(&mut c) else {
                return false;
            };
            let mut owners: Vec<(u16, u16, u16)> = parse_nodes(&text)
                .into_iter()
                .filter(|n| n.master)
                .flat_map(|n| {
                    n.slots
                        .iter()
                        .map(move |(a, b)| (*a, *b, n.port))
                        .collect::<Vec<_>>()
                })
                .collect();
            owners.sort_unstable();
            views.push(owners);
        }
        views.windows(2).all(|w| w[0] == w[1])
    }

    /// `redis://127.0.0.1:PORT` of every primary (the seed nodes a proxy is given).
    pub fn seeds(&self) -> Vec<String> {
        self.masters()
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port))
            .collect()
    }

    /// The `store:` lines of a proxy on this cluster (for [`super::Env::config_with`]-style
    /// configurations).
    pub fn store_lines(&self) -> String {
        format!(
            "backend: redis-cluster\nnodes: [{}]\n",
            self.seeds().join(", ")
        )
    }

    /// A connection to one node.
    pub fn conn(&self, port: u16) -> redis::Connection {
        try_conn(port).unwrap_or_else(|e| panic!("connect to cluster node {port}: {e}"))
    }

    /// `CLUSTER NODES` as one live node sees it.
    pub fn view(&self) -> Vec<NodeLine> {
        for node in &self.nodes {
            if let Ok(mut c) = try_conn(node.port)
                && let Ok(text) = redis::cmd("CLUSTER").arg("NODES").query::<String>(&mut c)
            {
                return parse_nodes(&text);
            }
        }
        panic!("no cluster node answers CLUSTER NODES");
    }

    /// The primaries, as the cluster sees them now.
    pub fn masters(&self) -> Vec<NodeLine> {
        self.view().into_iter().filter(|n| n.master).collect()
    }

    /// The slot of `key`.
    pub fn slot_of(&self, key: &str) -> u16 {
        let port = self.nodes[0].port;
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut self.conn(port))
            .expect("CLUSTER KEYSLOT")
    }

    /// The primary serving `slot` now.
    pub fn owner_of(&self, slot: u16) -> NodeLine {
        self.masters()
            .into_iter()
            .find(|n| n.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot)))
            .unwrap_or_else(|| panic!("no primary serves slot {slot}"))
    }

    /// A replica of the primary `master`.
    pub fn replica_of(&self, master: &NodeLine) -> NodeLine {
        self.view()
            .into_iter()
            .find(|n| n.master_id.as_deref() == Some(master.id.as_str()))
            .unwrap_or_else(|| panic!("primary {} has no replica", master.port))
    }

    /// Moves `slot` from primary `from` to primary `to` the way `redis-cli --cluster reshard`
    /// does: `IMPORTING` on the target, `MIGRATING` on the source, `MIGRATE` of its keys, then
    /// `SETSLOT … NODE` on the target, the source and every other primary. `between` runs after
    /// each step (1: importing/migrating set, 2: keys moved, 3: owner set everywhere), so a
    /// test can let traffic meet each state.
    pub fn migrate_slot(
        &self,
        slot: u16,
        from: &NodeLine,
        to: &NodeLine,
        mut between: impl FnMut(u32),
    ) {
        let mut src = self.conn(from.port);
        let mut dst = self.conn(to.port);
        let _: () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("IMPORTING")
            .arg(&from.id)
            .query(&mut dst)
            .expect("SETSLOT IMPORTING");
        let _: () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("MIGRATING")
            .arg(&to.id)
            .query(&mut src)
            .expect("SETSLOT MIGRATING");
        between(1);
        loop {
            let keys: Vec<String> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(100)
                .query(&mut src)
                .expect("GETKEYSINSLOT");
            if keys.is_empty() {
                break;
            }
            let _: () = redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(to.port)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys)
                .query(&mut src)
                .expect("MIGRATE");
        }
        between(2);
        for port in std::iter::once(to.port)
            .chain(std::iter::once(from.port))
            .chain(self.masters().iter().map(|m| m.port))
        {
            let _: () = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg("NODE")
                .arg(&to.id)
                .query(&mut self.conn(port))
                .expect("SETSLOT NODE");
        }
        self.wait_converged();
        between(3);
    }

    /// `CLUSTER FAILOVER` (coordinated: the replica catches up with its primary, which stops
    /// taking writes meanwhile, then takes over) sent to `replica`; waits until it serves as a
    /// primary and the cluster agrees.
    pub fn failover(&self, replica: &NodeLine) {
        let _: () = redis::cmd("CLUSTER")
            .arg("FAILOVER")
            .query(&mut self.conn(replica.port))
            .expect("CLUSTER FAILOVER");
        let id = replica.id.clone();
        wait_for(Duration::from_secs(20), "the failover", || {
            self.masters()
                .iter()
                .any(|m| m.id == id && !m.slots.is_empty())
        });
        self.wait_converged();
    }

    fn signal_all(&self, sig: &str) {
        for node in &self.nodes {
            if let Some(c) = &node.child {
                let _ = Command::new("kill")
                    .args([sig, &c.id().to_string()])
                    .status();
            }
        }
    }

    /// SIGSTOP on every node: the cluster hangs, connections stay open.
    pub fn pause_all(&self) {
        self.signal_all("-STOP");
    }

    /// SIGCONT on every node.
    pub fn resume_all(&self) {
        self.signal_all("-CONT");
    }

    /// SIGKILL on every node: the cluster is gone, connections are refused.
    pub fn kill_all(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut c) = node.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    /// Starts every node again on its port, with its `nodes-PORT.conf` (so the cluster forms
    /// again as it was, minus the data), and waits until it has converged.
    pub fn restart_all(&mut self) {
        self.kill_all();
        for node in &mut self.nodes {
            node.child = Some(spawn_node(
                self.dir.path(),
                node.port,
                node.bus,
                self.node_timeout_ms,
            ));
        }
        self.wait_converged();
    }

    /// The directory the nodes keep their `nodes-PORT.conf` in.
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        self.resume_all();
        for node in &mut self.nodes {
            if let Some(mut c) = node.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

fn spawn_node(dir: &std::path::Path, port: u16, bus: u16, node_timeout_ms: u32) -> Child {
    Command::new(super::redis_binary())
        .args([
            "--port",
            &port.to_string(),
            "--cluster-enabled",
            "yes",
            "--cluster-port",
            &bus.to_string(),
            "--cluster-config-file",
            &dir.join(format!("nodes-{port}.conf")).display().to_string(),
            "--cluster-node-timeout",
            &node_timeout_ms.to_string(),
            "--dir",
            &dir.display().to_string(),
            "--pidfile",
            &pidfile(dir, port).display().to_string(),
        ])
        .args(super::REDIS_EPHEMERAL)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn redis-server (install it: apt-get install redis-server)")
}

fn try_conn(port: u16) -> redis::RedisResult<redis::Connection> {
    redis::Client::open(format!("redis://127.0.0.1:{port}/"))?
        .get_connection_with_timeout(Duration::from_secs(2))
}

fn ping(port: u16) -> bool {
    try_conn(port)
        .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
        .is_ok()
}

/// Parses `CLUSTER NODES`.
pub fn parse_nodes(text: &str) -> Vec<NodeLine> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 8 {
                return None;
            }
            let port = f[1].split('@').next()?.rsplit(':').next()?.parse().ok()?;
            let flags = f[2];
            let master = flags.contains("master") && !flags.contains("fail");
            let master_id = (f[3] != "-").then(|| f[3].to_owned());
            let slots = f[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => {
                        let n = s.parse().ok()?;
                        Some((n, n))
                    }
                })
                .collect();
            Some(NodeLine {
                id: f[0].to_owned(),
                port,
                master,
                master_id,
                slots,
            })
        })
        .collect()
}

/// Where the node on `port` writes its process id (for [`reap_on_exit`]).
fn pidfile(dir: &std::path::Path, port: u16) -> std::path::PathBuf {
    dir.join(format!("redis-{port}.pid"))
}

/// A spare node lives in a `static`, which is never dropped: a watchdog process kills it and
/// removes its directory once this test binary has exited. Started before the node, it finds
/// the node by its pidfile, and kills that process only if it is still the node on `port`
/// (Redis names itself `redis-server 127.0.0.1:PORT`). It leaves as soon as the directory is
/// gone: a test took the node and dropped it.
fn reap_on_exit(port: u16, dir: &std::path::Path) {
    let me = std::process::id();
    let pidfile = pidfile(dir, port);
    let (dir, pidfile) = (dir.display(), pidfile.display());
    let script = format!(
        "while kill -0 {me} 2>/dev/null; do [ -d '{dir}' ] || exit 0; sleep 0.2; done; \
         sleep 0.5; \
         pid=$(cat '{pidfile}' 2>/dev/null) && tr '\\0' ' ' < /proc/$pid/cmdline 2>/dev/null | grep -q ':{port}\\b' && kill -KILL $pid; \
         rm -rf '{dir}'"
    );
    let _ = Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn();
}
