"""Which hosts and addresses a build's egress proxy lets it reach (campugrid.egress.policy)."""

import ipaddress

import pytest

from campugrid.egress.policy import DEFAULT_HOSTS, Policy, Refused, not_public, parse_pins


@pytest.mark.parametrize(("address", "why"), [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("10.1.2.3", "private"),
    ("192.168.1.1", "private"), ("172.16.0.9", "private"), ("169.254.169.254", "link-local"),
    ("fe80::1", "link-local"), ("100.64.0.1", "carrier-grade NAT"), ("224.0.0.251", "multicast"),
    ("0.0.0.0", "unspecified"), ("::ffff:127.0.0.1", "loopback"), ("fd00::1", "private"),
    ("240.0.0.1", "240.0.0.1 is"), ("203.0.113.80", "private"),  # 240/4: "private" to Python
])
def test_addresses_builds_never_reach(address, why):
    assert why in not_public(address)


@pytest.mark.parametrize("address", ["151.101.0.223", "2a04:4e42::223", "1.1.1.1"])
def test_public_addresses_are_reachable(address):
    assert not_public(address) == ""


def test_names_on_the_list_on_80_and_443_only():
    policy = Policy()
    assert "pypi.org" in DEFAULT_HOSTS and policy.target("PyPI.org.", 443) == "pypi.org"
    for host, port, says in (("example.org", 443, "not on this platform's list"),
                             ("pypi.org", 22, "ports 80 and 443 only"),
                             ("127.0.0.1", 443, "an address, not a name"),
                             ("[::1]", 443, "an address, not a name"),
                             ("pypi.org.evil.example", 443, "not on this platform's list")):
        with pytest.raises(Refused, match=says):
            policy.target(host, port)
    wild = Policy(hosts=("*.example.org",))
    assert wild.allows("a.b.example.org") and not wild.allows("example.org.evil")


def test_an_allowed_name_on_a_private_address_is_refused_unless_the_operator_says_so():
    policy = Policy(hosts=("localhost",))
    with pytest.raises(Refused, match=r"resolves to 127\.0\.0\.1.*loopback"):
        policy.addresses("localhost", 443)
    gateway = Policy(hosts=("localhost",), gateways=(ipaddress.ip_network("127.0.0.1/32"),))
    assert ("127.0.0.1", 443) in gateway.addresses("localhost", 443)
    # a pin is the operator's word for one name and port, whatever the address
    pinned = Policy(hosts=(), pins=parse_pins("files.example.test:443=10.0.0.5:8443"))
    assert pinned.addresses("files.example.test", 443) == [("10.0.0.5", 8443)]
    with pytest.raises(Refused):
        pinned.addresses("files.example.test", 80)


def test_the_operators_settings_are_checked():
    env = {"CAMPUGRID_EGRESS_HOSTS": "pypi.org *.example.org",
           "CAMPUGRID_EGRESS_PINS": "a.test:443=127.0.0.1:9443",
           "CAMPUGRID_EGRESS_GATEWAYS": "203.0.113.80/32"}
    policy = Policy.from_env(env)
    assert policy.hosts == ("pypi.org", "*.example.org")
    assert policy.pins == {("a.test", 443): ("127.0.0.1", 9443)}
    assert policy.gateways == (ipaddress.ip_network("203.0.113.80/32"),)
    assert Policy.from_env({}).hosts == DEFAULT_HOSTS
    for key, value, says in (("CAMPUGRID_EGRESS_HOSTS", "http://x", "not a host name"),
                             ("CAMPUGRID_EGRESS_PINS", "a.test=1.2.3.4", "name:port=address:port"),
                             ("CAMPUGRID_EGRESS_PINS", "a.test:443=b.test:443", "name:port="),
                             ("CAMPUGRID_EGRESS_GATEWAYS", "not-a-net", "GATEWAYS")):
        with pytest.raises(ValueError, match=says):
            Policy.from_env({key: value})
