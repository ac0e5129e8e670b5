//! examples/kubernetes/: the manifests pass the Kubernetes schemas
//! (`python3 -m kubernetes_validate --strict`, which scripts/test
//! installs), the
//! config and rules their ConfigMaps carry pass `tollgate check`, and the
//! Deployment keeps what docs/operations.md recommends (probes, a grace
//! period above shutdown_delay + drain_timeout, a read-only non-root
//! container).

use std::path::{Path, PathBuf};
use std::process::Command;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/kubernetes")
}

fn manifests() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir())
        .expect("examples/kubernetes")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

/// Runs python3 with `script`; its stdout, or a panic with its stderr.
fn python(script: &str, args: &[&str]) -> String {
    let out = Command::new("python3").arg("-c").arg(script).args(args).output().expect("python3 runs");
    assert!(out.status.success(), "python3 failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_manifests_pass_the_kubernetes_schemas() {
    let files = manifests();
    assert!(files.len() >= 5, "{files:?}");
    let out = Command::new("python3")
        .args(["-m", "kubernetes_validate", "--strict"])
        .args(&files)
        .output()
        .expect("kubernetes-validate runs (scripts/test installs it with pip)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    for kind in
        ["deployment", "service", "poddisruptionbudget", "configmap/tollgate-config", "configmap/tollgate-rules"]
    {
        assert!(text.contains(&format!("passed for resource {kind}")), "{kind} not validated:\n{text}");
    }
    // The check can fail: a misspelt field is refused.
    let tmp = tempfile::tempdir().expect("temp dir");
    let broken = std::fs::read_to_string(dir().join("deployment.yaml"))
        .expect("deployment")
        .replace("readinessProbe", "readynessProbe");
    std::fs::write(tmp.path().join("d.yaml"), broken).expect("write");
    let out = Command::new("python3")
        .args(["-m", "kubernetes_validate", "--strict"])
        .arg(tmp.path().join("d.yaml"))
        .output()
        .expect("runs");
    assert!(!out.status.success(), "a misspelt field passed");
}

/// Writes the ConfigMaps' files into `into`: `tollgate.toml` (its rules
/// path pointed at `into/rules`) and `rules/*`.
fn unpack_configmaps(into: &Path) {
    let script = r#"
import sys, yaml, os
out = sys.argv[1]
os.makedirs(os.path.join(out, "rules"), exist_ok=True)
for path in sys.argv[2:]:
    for doc in yaml.safe_load_all(open(path)):
        if not doc or doc.get("kind") != "ConfigMap":
            continue
        sub = "" if doc["metadata"]["name"] == "tollgate-config" else "rules"
        for name, text in doc["data"].items():
            open(os.path.join(out, sub, name), "w").write(text)
            print(os.path.join(sub, name))
"#;
    let files: Vec<String> = manifests().iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let mut args = vec![into.to_str().expect("utf-8 path")];
    args.extend(files.iter().map(String::as_str));
    let written = python(script, &args);
    assert!(written.lines().any(|l| l == "tollgate.toml"), "{written}");
    let main = into.join("tollgate.toml");
    let text = std::fs::read_to_string(&main).expect("tollgate.toml");
    assert!(text.contains("path = \"/etc/tollgate/rules\""), "the rules path the Deployment mounts");
    std::fs::write(&main, text.replace("/etc/tollgate/rules", &into.join("rules").to_string_lossy())).expect("write");
}

#[test]
fn the_config_the_configmaps_carry_passes_tollgate_check() {
    let tmp = tempfile::tempdir().expect("temp dir");
    unpack_configmaps(tmp.path());
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["check", "--config"])
        .arg(tmp.path().join("tollgate.toml"))
        .output()
        .expect("tollgate check runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains(": ok"), "{text}");
}

#[test]
fn the_deployment_keeps_what_the_docs_recommend() {
    let script = r#"
import sys, yaml, json
d = yaml.safe_load(open(sys.argv[1]))
spec = d["spec"]["template"]["spec"]
c = spec["containers"][0]
print(json.dumps({
    "grace": spec["terminationGracePeriodSeconds"],
    "readiness": c["readinessProbe"]["httpGet"]["path"],
    "liveness": c["livenessProbe"]["httpGet"]["path"],
    "read_only": c["securityContext"]["readOnlyRootFilesystem"],
    "non_root": spec["securityContext"]["runAsNonRoot"],
}))
"#;
    let out = python(script, &[&dir().join("deployment.yaml").to_string_lossy()]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
    assert_eq!(v["readiness"], "/readyz");
    assert_eq!(v["liveness"], "/healthz");
    assert_eq!(v["read_only"], true);
    assert_eq!(v["non_root"], true);
    // Above shutdown_delay + drain_timeout of the config it carries.
    let tmp = tempfile::tempdir().expect("temp dir");
    unpack_configmaps(tmp.path());
    let config = tollgate::config::Config::load(&tmp.path().join("tollgate.toml")).expect("the config loads");
    let needed = config.listen.shutdown_delay + config.listen.drain_timeout;
    assert!(v["grace"].as_u64().expect("seconds") > needed.as_secs(), "grace {} <= {needed:?}", v["grace"]);
}
