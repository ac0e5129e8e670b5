//! tollgate keeps transparent huge pages off for itself: mimalloc asks for
//! them on every arena it maps, and a huge page holds 2 MiB resident for
//! what a few idle connections use of it (docs/benchmarks.md, "idle
//! connections"). An operator who wants them sets `MIMALLOC_ALLOW_THP`,
//! which then decides, as mimalloc documents.

mod support;

use support::process::Process;

const CONFIG: &str = "[listen]\nproxy = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n\n[rules]\npath = \"rules\"\n\n\
                      [[upstream]]\nname = \"svc\"\nurl = \"http://127.0.0.1:9\"\n\n\
                      [[route]]\npath_prefix = \"/\"\nupstream = \"svc\"\n";
const RULES: &str = "[[rule]]\nname = \"per-ip\"\nkey = [\"ip\"]\nlimit = 10\nwindow = \"1s\"\n";

#[test]
fn huge_pages_are_off_unless_the_operator_asks() {
    let plain = Process::start(CONFIG, RULES, &[]);
    // The kernel says whether THP is allowed for a process (Linux 5.0+).
    let Some(enabled) = plain.status("THP_enabled") else {
        eprintln!("this kernel does not report THP_enabled; nothing to check");
        return;
    };
    assert_eq!(enabled, "0", "tollgate must turn transparent huge pages off for itself");
    let asked = Process::start(CONFIG, RULES, &[("MIMALLOC_ALLOW_THP", "1")]);
    assert_eq!(asked.status("THP_enabled").as_deref(), Some("1"), "MIMALLOC_ALLOW_THP=1 leaves them on");
}
