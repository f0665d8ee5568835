//! kube-proxy's configuration file: the fuzzer's bytes are the file. Whatever they are,
//! reading gives a configuration or an error naming a field, never a panic; what reads
//! is written back (`--write-config-to`) as a file that reads as the same configuration;
//! the accessors kxp's start calls on it answer.

use controlplane::config::KubeProxyConfiguration;

pub fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cfg) = KubeProxyConfiguration::parse(text, "fuzz") else {
        return;
    };
    let _ = cfg.not_honoured();
    let _ = cfg.masquerade_all();
    let _ = cfg.scheduler();
    let written = serde_yaml::to_string(&cfg).expect("a configuration that read is written");
    let again = KubeProxyConfiguration::parse(&written, "written")
        .unwrap_or_else(|e| panic!("what kxp wrote does not read: {e}\n{written}"));
    assert_eq!(again, cfg, "written and read back:\n{written}");
}
