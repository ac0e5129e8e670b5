//! Real `redis-server` processes for the Redis tests: a single node
//! ([`RedisServer`]) and a cluster of 3 masters + 3 replicas
//! ([`RedisCluster`]), on free loopback ports below 55535 (a cluster node's
//! bus port is its port + 10000), each node with its own directory and
//! cluster config file under a temporary directory.
//!
//! Everything started here is stopped when its value is dropped. A value
//! kept in a `static` (one cluster shared by a test binary) is never
//! dropped, so a small watchdog shell stops the nodes and removes their
//! directory once the test process is gone, however it ended.
//!
//! Administration goes through `redis-cli`, as an operator would do it.
#![allow(dead_code)]

use std::io::Write as _;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How long a node, or the whole cluster, may take to become ready.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// Whether `redis-server` and `redis-cli` are on the PATH (`scripts/test`
/// installs them).
/// The arguments of a `redis-cli` call that reads a fixed window's state,
/// stored as two doubles (`fixed_window.lua`), as the text
/// `"<window start µs>:<count>"`, or "" when there is no key.
pub fn window(key: &str) -> [&str; 4] {
    const READ: &str = "local s = redis.call('GET', KEYS[1]) if not s then return '' end \
                        return string.format('%d:%d', struct.unpack('<dd', s))";
    ["EVAL", READ, "1", key]
}

fn available() -> bool {
    let runs = |bin: &str| Command::new(bin).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status();
    matches!(runs("redis-server"), Ok(s) if s.success()) && matches!(runs("redis-cli"), Ok(s) if s.success())
}

/// Fails the test when redis-server or redis-cli is missing: a test that
/// returned early would pass without having checked anything.
pub fn require() {
    assert!(available(), "redis-server and redis-cli are needed (scripts/test installs them)");
}

/// Runs `redis-cli -p port args...` and returns its output (errors too:
/// redis-cli prints server errors on stdout).
pub fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run redis-cli: {e}"));
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    text
}

/// Where the next search for free ports starts: spread by process id so
/// that test binaries running at once rarely probe the same ports (40
/// apart: a test process run by cargo-nextest, one per test, with a
/// cluster takes a dozen), below 22700 so that no node's port is another's
/// bus port (10000 above) and no bus port is in the kernel's range of
/// ephemeral ports (32768 and up), where the connections of tests running
/// at once would take them; a server that still meets another's port is
/// caught by `start_with`.
static NEXT_PORT: AtomicU16 = AtomicU16::new(0);

/// `n` consecutive free ports `p..p+n` whose bus ports `p+10000..` are free
/// too, all below 32700.
pub fn free_ports(n: u16) -> Vec<u16> {
    let _ = NEXT_PORT.compare_exchange(
        0,
        20_000 + (std::process::id() % 65) as u16 * 40,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    loop {
        let base = NEXT_PORT.fetch_add(n + 1, Ordering::SeqCst);
        if base + n >= 22_700 {
            NEXT_PORT.store(20_000, Ordering::SeqCst);
            continue;
        }
        let ports: Vec<u16> = (base..base + n).collect();
        let free = |p: u16| TcpListener::bind(("127.0.0.1", p)).is_ok();
        if ports.iter().all(|&p| free(p) && free(p + 10_000)) && ports.iter().all(|&p| reserve(p)) {
            return ports;
        }
    }
}

/// Claims `port` for this test process until it ends, across the test
/// processes running at once: a test that stops a server and starts it
/// again on its port (`restart`) must not find it taken by another test's
/// server in between. A claim is a file naming the claiming process; one
/// whose process is gone is taken over.
fn reserve(port: u16) -> bool {
    let dir = std::env::temp_dir().join("tollgate-test-ports");
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(port.to_string());
    let me = std::process::id().to_string();
    if let Ok(owner) = std::fs::read_to_string(&path) {
        let owner = owner.trim();
        if owner == me {
            return true;
        }
        // Empty: a claim being written this moment.
        if owner.is_empty() || Path::new("/proc").join(owner).exists() {
            return false;
        }
        let _ = std::fs::remove_file(&path);
    }
    match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
        Ok(mut f) => std::io::Write::write_all(&mut f, me.as_bytes()).is_ok(),
        Err(_) => false,
    }
}

/// The processes of one deployment and the directory they write to.
struct Processes {
    dir: PathBuf,
    /// One slot per node; `None` while a node is killed.
    children: Mutex<Vec<(u16, Option<Child>)>>,
    /// Cluster mode flags.
    cluster: bool,
}

impl Processes {
    fn new(ports: &[u16], cluster: bool) -> Processes {
        let dir = tempfile::Builder::new()
            .prefix("tollgate-redis-")
            .tempdir()
            .unwrap_or_else(|e| panic!("temp dir: {e}"))
            .keep();
        let p = Processes { dir, children: Mutex::new(ports.iter().map(|&p| (p, None)).collect()), cluster };
        p.spawn_watchdog();
        p
    }

    /// A shell that waits for this test process to exit, then kills every
    /// node whose pid is listed in `pids` and removes the directory.
    fn spawn_watchdog(&self) {
        let script = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 0.3; done; \
             for p in $(cat '{dir}/pids' 2>/dev/null); do kill -9 $p 2>/dev/null; done; rm -rf '{dir}'",
            pid = std::process::id(),
            dir = self.dir.display()
        );
        let _ = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
    }

    fn node_dir(&self, port: u16) -> PathBuf {
        self.dir.join(port.to_string())
    }

    /// Starts (or restarts) the node on `port` and waits until it answers.
    fn start(&self, port: u16) {
        self.start_with(port, &[]);
    }

    /// [`Processes::start`] with `extra` arguments for redis-server.
    fn start_with(&self, port: u16, extra: &[String]) {
        let dir = self.node_dir(port);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("node dir: {e}"));
        let mut args: Vec<String> = [
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--dir",
            &dir.display().to_string(),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--logfile",
            "redis.log",
            "--repl-diskless-sync",
            "yes",
            "--repl-diskless-sync-delay",
            "0",
            "--protected-mode",
            "no",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().cloned());
        if self.cluster {
            for a in [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                &format!("nodes-{port}.conf"),
                "--cluster-node-timeout",
                "1000",
            ] {
                args.push(a.to_string());
            }
        }
        let pid = self.spawn(port, Command::new("redis-server").args(&args));
        // Answered by this node, not by another test's that took the port
        // first (this one then exits, and the test would wait on a server
        // that goes away with the other test).
        let me = format!("process_id:{pid}");
        wait_until(&format!("redis on port {port} answers"), || {
            if let Some(status) = self.exited(port) {
                let log = std::fs::read_to_string(self.node_dir(port).join("redis.log")).unwrap_or_default();
                panic!("redis-server on port {port} exited ({status}): {}", log.lines().last().unwrap_or(""));
            }
            cli(port, &["INFO", "server"]).lines().any(|l| l.trim() == me)
        });
    }

    /// How the node on `port` ended, if it has.
    fn exited(&self, port: u16) -> Option<std::process::ExitStatus> {
        let mut children = self.children.lock();
        let (_, child) = children.iter_mut().find(|(p, _)| *p == port)?;
        child.as_mut()?.try_wait().ok().flatten()
    }

    /// Starts `cmd` (a redis-server or sentinel) as the process of `port`,
    /// recording its pid for clean-up.
    fn spawn(&self, port: u16, cmd: &mut Command) -> u32 {
        let child =
            cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap_or_else(|e| {
                panic!("cannot start redis-server (is it installed? scripts/test installs it): {e}")
            });
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("pids")) {
            let _ = writeln!(f, "{}", child.id());
        }
        let mut children = self.children.lock();
        let pid = child.id();
        match children.iter_mut().find(|(p, _)| *p == port) {
            Some(slot) => slot.1 = Some(child),
            None => children.push((port, Some(child))),
        }
        pid
    }

    /// Starts a Sentinel on `port` monitoring the master on `master` as
    /// `tollgate`, and waits until it knows the master.
    fn start_sentinel(&self, port: u16, master: u16) {
        let dir = self.node_dir(port);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("sentinel dir: {e}"));
        // Sentinel rewrites its config file, so it gets one of its own.
        let conf = dir.join("sentinel.conf");
        let text = format!(
            "port {port}\nbind 127.0.0.1\ndir {}\nlogfile sentinel.log\nsentinel monitor tollgate 127.0.0.1 {master} 1\nsentinel down-after-milliseconds tollgate 1000\n",
            dir.display()
        );
        std::fs::write(&conf, text).unwrap_or_else(|e| panic!("sentinel config: {e}"));
        self.spawn(port, Command::new("redis-server").arg(&conf).arg("--sentinel"));
        wait_until(&format!("sentinel on port {port} knows the master"), || {
            cli(port, &["SENTINEL", "get-master-addr-by-name", "tollgate"]).contains(&master.to_string())
        });
    }

    /// `kill -9` the node on `port`.
    fn kill(&self, port: u16) {
        let mut children = self.children.lock();
        if let Some((_, Some(child))) = children.iter_mut().find(|(p, _)| *p == port) {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(slot) = children.iter_mut().find(|(p, _)| *p == port) {
            slot.1 = None;
        }
    }
}

impl Drop for Processes {
    fn drop(&mut self) {
        let mut children = self.children.lock();
        for (_, child) in children.iter_mut() {
            if let Some(c) = child.as_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Polls `condition` every 50 ms; panics after [`READY_WITHIN`].
pub fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let started = Instant::now();
    while !condition() {
        assert!(started.elapsed() < READY_WITHIN, "gave up after {READY_WITHIN:?} waiting for: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One standalone `redis-server`.
pub struct RedisServer {
    pub port: u16,
    processes: Processes,
}

impl RedisServer {
    /// Starts a node on a free port and waits until it answers.
    pub fn start() -> RedisServer {
        let port = free_ports(1)[0];
        let processes = Processes::new(&[port], false);
        processes.start(port);
        RedisServer { port, processes }
    }

    /// [`RedisServer::start`] with `extra` arguments for redis-server.
    pub fn start_with(extra: &[&str]) -> RedisServer {
        let port = free_ports(1)[0];
        let processes = Processes::new(&[port], false);
        processes.start_with(port, &extra.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        RedisServer { port, processes }
    }

    /// A port with nothing listening, for "Redis is down from the start":
    /// [`RedisServer::start_on`] can bring a node up there later.
    pub fn unused_port() -> u16 {
        free_ports(1)[0]
    }

    /// Starts a node on `port` (chosen by [`RedisServer::unused_port`]).
    pub fn start_on(port: u16) -> RedisServer {
        let processes = Processes::new(&[port], false);
        processes.start(port);
        RedisServer { port, processes }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `kill -9` the server.
    pub fn kill(&self) {
        self.processes.kill(self.port);
    }

    /// Starts it again on the same port (empty: nothing is persisted).
    pub fn restart(&self) {
        self.processes.start(self.port);
    }

    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, args)
    }
}

/// One standalone `redis-server` that also speaks TLS, with a certificate
/// for `localhost` and `127.0.0.1` issued by a CA made for the test. The
/// plain port is only for the test's own `redis-cli`.
pub struct RedisTlsServer {
    pub port: u16,
    pub tls_port: u16,
    /// The CA certificate (PEM) a client must trust.
    pub ca_file: PathBuf,
    /// A client certificate and key the same CA issued, for a server that
    /// asks for one.
    pub client_cert_file: PathBuf,
    pub client_key_file: PathBuf,
    _processes: Processes,
}

impl RedisTlsServer {
    /// `require_client_cert`: Redis's `tls-auth-clients yes`.
    pub fn start(require_client_cert: bool) -> RedisTlsServer {
        let ports = free_ports(2);
        let (port, tls_port) = (ports[0], ports[1]);
        let processes = Processes::new(&[port], false);
        let pki = processes.dir.join("pki");
        std::fs::create_dir_all(&pki).unwrap_or_else(|e| panic!("pki dir: {e}"));
        let pki_files = test_pki();
        let write = |name: &str, text: &str| {
            let path = pki.join(name);
            std::fs::write(&path, text).unwrap_or_else(|e| panic!("write {name}: {e}"));
            path.display().to_string()
        };
        let ca_file = write("ca.crt", &pki_files.ca);
        let client_cert_file = PathBuf::from(write("client.crt", &pki_files.client_cert));
        let client_key_file = PathBuf::from(write("client.key", &pki_files.client_key));
        let extra: Vec<String> = [
            "--tls-port",
            &tls_port.to_string(),
            "--tls-cert-file",
            &write("server.crt", &pki_files.server_cert),
            "--tls-key-file",
            &write("server.key", &pki_files.server_key),
            "--tls-ca-cert-file",
            &ca_file,
            "--tls-auth-clients",
            if require_client_cert { "yes" } else { "no" },
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        processes.start_with(port, &extra);
        RedisTlsServer {
            port,
            tls_port,
            ca_file: PathBuf::from(ca_file),
            client_cert_file,
            client_key_file,
            _processes: processes,
        }
    }

    /// `rediss://` to the TLS port, by the certificate's host name.
    pub fn url(&self) -> String {
        format!("rediss://localhost:{}", self.tls_port)
    }

    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, args)
    }
}

/// A test CA and what it issued, all PEM.
struct TestPki {
    ca: String,
    /// For `localhost` and `127.0.0.1`.
    server_cert: String,
    server_key: String,
    client_cert: String,
    client_key: String,
}

fn test_pki() -> TestPki {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let fail = |e: rcgen::Error| -> ! { panic!("test certificates: {e}") };
    let ca_key = KeyPair::generate().unwrap_or_else(|e| fail(e));
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap_or_else(|e| fail(e));
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(DnType::CommonName, "tollgate test CA");
    let ca = ca_params.self_signed(&ca_key).unwrap_or_else(|e| fail(e));
    let issuer = Issuer::new(ca_params, ca_key);
    let issue = |names: Vec<String>| {
        let key = KeyPair::generate().unwrap_or_else(|e| fail(e));
        let cert = CertificateParams::new(names).and_then(|p| p.signed_by(&key, &issuer)).unwrap_or_else(|e| fail(e));
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = issue(vec!["localhost".to_string(), "127.0.0.1".to_string()]);
    let (client_cert, client_key) = issue(vec!["tollgate".to_string()]);
    TestPki { ca: ca.pem(), server_cert, server_key, client_cert, client_key }
}

/// One master behind one Sentinel, which names it `tollgate`.
pub struct RedisSentinel {
    pub master: u16,
    pub sentinel: u16,
    processes: Processes,
}

impl RedisSentinel {
    pub fn start() -> RedisSentinel {
        let ports = free_ports(2);
        let (master, sentinel) = (ports[0], ports[1]);
        let processes = Processes::new(&ports, false);
        processes.start(master);
        processes.start_sentinel(sentinel, master);
        RedisSentinel { master, sentinel, processes }
    }

    /// `redis-sentinel://` naming the sentinel and the service.
    pub fn url(&self) -> String {
        format!("redis-sentinel://127.0.0.1:{}?sentinelServiceName=tollgate", self.sentinel)
    }
}

/// A Redis Cluster of 3 masters and 3 replicas.
pub struct RedisCluster {
    /// Every node's port; which are masters changes with failovers.
    pub ports: Vec<u16>,
    processes: Processes,
}

/// One line of `CLUSTER NODES`.
#[derive(Debug, Clone)]
pub struct ClusterNode {
    pub id: String,
    pub port: u16,
    pub master: bool,
    pub failed: bool,
    /// Slot ranges served (masters only), inclusive.
    pub slots: Vec<(u16, u16)>,
}

impl RedisCluster {
    /// Starts six nodes, creates the cluster with `redis-cli --cluster
    /// create ... --cluster-replicas 1`, and waits until every node reports
    /// `cluster_state:ok` and knows all six, and every replica's link to its
    /// master is up.
    pub fn start() -> RedisCluster {
        let ports = free_ports(6);
        let processes = Processes::new(&ports, true);
        for &p in &ports {
            processes.start(p);
        }
        let mut args: Vec<String> = vec!["--cluster".into(), "create".into()];
        args.extend(ports.iter().map(|p| format!("127.0.0.1:{p}")));
        args.extend(["--cluster-replicas", "1", "--cluster-yes"].map(String::from));
        let out = Command::new("redis-cli")
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run redis-cli --cluster create: {e}"));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("[OK] All 16384 slots covered"), "cluster create failed:\n{text}");
        let cluster = RedisCluster { ports, processes };
        cluster.wait_ready();
        cluster
    }

    /// Waits for `cluster_state:ok` everywhere, six known nodes, three
    /// masters with slots and every replica linked.
    pub fn wait_ready(&self) {
        wait_until("the cluster is ready", || {
            let alive = self.alive();
            alive.iter().all(|&p| {
                let info = cli(p, &["CLUSTER", "INFO"]);
                info.contains("cluster_state:ok") && info.contains(&format!("cluster_known_nodes:{}", self.ports.len()))
            }) && self.nodes().iter().filter(|n| n.master && !n.slots.is_empty()).count() == 3
                && alive.iter().all(|&p| {
                    let repl = cli(p, &["INFO", "replication"]);
                    repl.contains("role:master") || repl.contains("master_link_status:up")
                })
        });
    }

    /// Ports of the nodes running now.
    pub fn alive(&self) -> Vec<u16> {
        let children = self.processes.children.lock();
        children.iter().filter(|(_, c)| c.is_some()).map(|(p, _)| *p).collect()
    }

    /// `redis-cluster://` with every node as a seed.
    pub fn url(&self) -> String {
        let mut url = format!("redis-cluster://127.0.0.1:{}", self.ports[0]);
        for (i, p) in self.ports[1..].iter().enumerate() {
            url.push(if i == 0 { '?' } else { '&' });
            url.push_str(&format!("node=127.0.0.1:{p}"));
        }
        url
    }

    /// The cluster as a live node sees it.
    pub fn nodes(&self) -> Vec<ClusterNode> {
        let Some(&port) = self.alive().first() else { return Vec::new() };
        parse_nodes(&cli(port, &["CLUSTER", "NODES"]))
    }

    /// The master serving `key`'s slot now (by a live node's view).
    pub fn master_of(&self, key: &str) -> Option<u16> {
        let slot = fred::util::redis_keyslot(key.as_bytes());
        self.nodes()
            .into_iter()
            .find(|n| n.master && !n.failed && n.slots.iter().any(|&(a, b)| (a..=b).contains(&slot)))
            .map(|n| n.port)
    }

    /// The port of every master, in slot order.
    pub fn masters(&self) -> Vec<u16> {
        let mut m: Vec<ClusterNode> =
            self.nodes().into_iter().filter(|n| n.master && !n.failed && !n.slots.is_empty()).collect();
        m.sort_by_key(|n| n.slots.first().map_or(0, |s| s.0));
        m.into_iter().map(|n| n.port).collect()
    }

    /// `kill -9` the node on `port`.
    pub fn kill(&self, port: u16) {
        self.processes.kill(port);
    }

    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        cli(port, args)
    }

    pub fn dir(&self) -> &Path {
        &self.processes.dir
    }
}

fn parse_nodes(text: &str) -> Vec<ClusterNode> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 8 {
                return None;
            }
            let port = f[1].split('@').next()?.rsplit(':').next()?.parse().ok()?;
            let flags = f[2];
            let slots = f[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => s.parse().ok().map(|x| (x, x)),
                })
                .collect();
            Some(ClusterNode {
                id: f[0].to_string(),
                port,
                master: flags.contains("master"),
                failed: flags.contains("fail") && !flags.contains("fail?"),
                slots,
            })
        })
        .collect()
}

/// The `nth` client address (from 0) whose bucket for the `ip`-keyed rule
/// `rule` falls in a slot the master on `port` serves: lets a test aim at
/// one node.
pub fn ip_on_master(cluster: &RedisCluster, rule: &str, port: u16, nth: usize) -> String {
    let ranges = cluster.nodes().into_iter().find(|n| n.port == port).map(|n| n.slots).unwrap_or_default();
    (0..=255u16)
        .flat_map(|a| (1..=254u16).map(move |b| format!("10.9.{a}.{b}")))
        .filter(|ip| {
            // Only the hash tag counts: `{<rule>|ip=<ip>}`.
            let slot = fred::util::redis_keyslot(format!("{{{rule}|ip={ip}}}").as_bytes());
            ranges.iter().any(|&(a, b)| (a..=b).contains(&slot))
        })
        .nth(nth)
        .unwrap_or_else(|| panic!("no address maps to the master on {port}"))
}

/// The main config of [`super::config`] with a `[store]` table for Redis at
/// `url`; `store` adds lines to that table (`on_error`, `timeout`,
/// `key_prefix`...). The default timeout here is generous (a loaded CI
/// machine must not turn a slow answer into a policy decision); tests of
/// timeouts set their own.
pub fn tollgate_config(upstream: std::net::SocketAddr, url: &str, store: &str) -> String {
    let store = if store.contains("timeout") { store.to_string() } else { format!("timeout = \"500ms\"\n{store}") };
    format!("{}\n[store]\nbackend = \"redis\"\nurl = \"{url}\"\n{store}\n", super::config(upstream))
}

/// A Redis Cluster of a test's own, for a test that stops, pauses or kills
/// its nodes (the clusters shared by a test binary must not see that), and
/// an upstream for the tollgates it starts on the cluster.
pub struct OwnCluster {
    pub cluster: std::sync::Arc<RedisCluster>,
    pub up: super::Upstream,
}

impl OwnCluster {
    /// Starts the cluster (on a blocking thread: it takes seconds) and the
    /// upstream.
    pub async fn start() -> OwnCluster {
        let cluster = tokio::task::spawn_blocking(RedisCluster::start).await.expect("cluster");
        OwnCluster { cluster: std::sync::Arc::new(cluster), up: super::Upstream::start().await }
    }

    /// A tollgate on the cluster: `store` adds lines to its `[store]` table
    /// (see [`tollgate_config`]), `rules` is its rules file.
    pub async fn tollgate(&self, store: &str, rules: &str) -> super::Tollgate {
        let config = tollgate_config(self.up.addr, &self.cluster.url(), store);
        super::Tollgate::with(&config, &[("rules.toml", rules)]).await
    }
}

/// A `[[rule]]` named `name` for the path `/name`, keyed on the client
/// address, `limit` per hour with `algorithm`; `extra` adds lines to its
/// table (`on_error = "deny"`).
pub fn hourly_rule(name: &str, algorithm: &str, limit: u64, extra: &str) -> String {
    format!(
        "[[rule]]\nname = \"{name}\"\nmatch = {{ path = \"/{name}\" }}\nkey = [\"ip\"]\nalgorithm = \"{algorithm}\"\nlimit = {limit}\nwindow = \"1h\"\n{extra}\n"
    )
}
