"""cluster.yaml against Ray's real AWS bootstrap code and an AWS API on 127.0.0.1 (moto's server).

The test does what a user does once per account: runs `docs/aws/setup.sh` (the real AWS CLI, pointed
at the local server with AWS_ENDPOINT_URL) in a VPC of theirs, fills cluster.yaml's CHANGE-ME values
with what it printed, then lets Ray bootstrap the file (what `ray up` does before it starts the
head) and start a head and a worker instance through Ray's own AWS node provider. What must hold
afterwards: no ingress from the whole internet and none to the dashboard, separate instance
profiles with EC2 and IAM rights on the head only, IMDSv2 required on every instance.

A control shows why the file names its security group: a group Ray creates from
``provider.security_group`` gets SSH from 0.0.0.0/0 ahead of the rules the file gives.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, free_ports

BIN = Path(sys.executable).parent
CIDR = "203.0.113.0/24"
BUCKET = "raylaunch-test-runs"


@pytest.fixture(scope="module")
def aws(tmp_path_factory):
    """An AWS API on 127.0.0.1 and an environment (this process's too) that points boto3 and the CLI at it."""
    from moto.server import ThreadedMotoServer

    if not (BIN / "aws").exists():
        pytest.skip("needs the AWS CLI (the test extra `awscli`)")
    (port,) = free_ports(1)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    values = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
              "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-west-2",
              "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
              "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield {"env": {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"},
               "home": tmp_path_factory.mktemp("aws")}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def _users_network(region: str, zone: str) -> tuple[str, str]:
    """The VPC and public subnet the user already has."""
    import boto3

    ec2 = boto3.client("ec2", region_name=region)
    vpc = ec2.create_vpc(CidrBlock="10.42.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.42.1.0/24", AvailabilityZone=zone)["Subnet"]["SubnetId"]
    ec2.modify_subnet_attribute(SubnetId=subnet, MapPublicIpOnLaunch={"Value": True})  # the laptop SSHes in
    return vpc, subnet


def _filled(aws, sg: str, subnet: str) -> dict:
    """cluster.yaml with the user's values where it says CHANGE-ME."""
    import boto3

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    ec2 = boto3.client("ec2", region_name=config["provider"]["region"])
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    key_path = aws["home"] / "raylaunch.pem"
    if not key_path.exists():  # the key pair cluster.yaml names (KeyName: raylaunch)
        key_path.write_text(ec2.create_key_pair(KeyName="raylaunch")["KeyMaterial"])
    config["auth"]["ssh_private_key"] = str(key_path)
    for node_type in config["available_node_types"].values():
        node_config = node_type["node_config"]
        node_config.update(ImageId=image, SubnetIds=[subnet], SecurityGroupIds=[sg])
    return config


def _ingress(sg: str) -> list[dict]:
    import boto3

    return boto3.client("ec2").describe_security_groups(GroupIds=[sg])["SecurityGroups"][0]["IpPermissions"]


def _opens_to_world(permissions: list[dict]) -> list[dict]:
    return [p for p in permissions if any(r.get("CidrIp") == "0.0.0.0/0" for r in p.get("IpRanges", []))
            or any(r.get("CidrIpv6") == "::/0" for r in p.get("Ipv6Ranges", []))]


def _actions(role: str) -> list[str]:
    import boto3

    iam = boto3.client("iam")
    found = []
    for name in iam.list_role_policies(RoleName=role)["PolicyNames"]:
        doc = iam.get_role_policy(RoleName=role, PolicyName=name)["PolicyDocument"]
        doc = json.loads(doc) if isinstance(doc, str) else doc
        for statement in doc["Statement"]:
            actions = statement["Action"]
            found += [actions] if isinstance(actions, str) else actions
    for attached in iam.list_attached_role_policies(RoleName=role)["AttachedPolicies"]:
        found.append(f"managed:{attached['PolicyArn']}")
    return found


def test_setup_then_rays_bootstrap_keep_ssh_narrow_and_profiles_apart(aws):
    import boto3
    from ray.autoscaler._private.aws.config import bootstrap_aws
    from ray.autoscaler._private.aws.node_provider import AWSNodeProvider
    from ray.autoscaler._private.util import prepare_config, validate_config
    from ray.autoscaler.tags import TAG_RAY_NODE_KIND, TAG_RAY_NODE_NAME, TAG_RAY_USER_NODE_TYPE

    shipped = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    vpc, subnet = _users_network(shipped["provider"]["region"], shipped["provider"]["availability_zone"])
    # the user refuses to open SSH to the world: the script says no before it creates anything
    refused = subprocess.run(["bash", str(ROOT / "docs" / "aws" / "setup.sh"), vpc, "0.0.0.0/0", BUCKET],
                             env=aws["env"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "refusing to open SSH to the world" in refused.stderr
    assert not boto3.client("iam").list_roles()["Roles"]
    done = subprocess.run(["bash", str(ROOT / "docs" / "aws" / "setup.sh"), vpc, CIDR, BUCKET],
                          env=aws["env"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    sg = done.stdout.split("SecurityGroupIds: [", 1)[1].split("]", 1)[0]

    config = prepare_config(_filled(aws, sg, subnet))
    validate_config(config)  # as `ray up` does, before bootstrapping
    config = bootstrap_aws(config)

    # the one security group: nodes reach each other, SSH from the user's range, nothing else
    for node_type in config["available_node_types"].values():
        assert node_type["node_config"]["SecurityGroupIds"] == [sg]
    ingress = _ingress(sg)
    assert not _opens_to_world(ingress), ingress
    assert {(p["IpProtocol"], p.get("FromPort")) for p in ingress} == {("-1", None), ("tcp", 22)}
    ssh = next(p for p in ingress if p.get("FromPort") == 22)
    assert [r["CidrIp"] for r in ssh["IpRanges"]] == [CIDR]
    every = next(p for p in ingress if p["IpProtocol"] == "-1")
    assert [g["GroupId"] for g in every["UserIdGroupPairs"]] == [sg] and not every.get("IpRanges")
    assert not [p for p in ingress if p.get("FromPort") is not None and p["FromPort"] <= 8265 <= p["ToPort"]]

    # start a head and a worker the way `ray up` and the autoscaler do, and look at what EC2 has
    provider = AWSNodeProvider(config["provider"], config["cluster_name"])
    for kind, type_name in (("head", config["head_node_type"]), ("worker", "gpu_worker")):
        node_config = copy.deepcopy(config["available_node_types"][type_name]["node_config"])
        if kind == "head":
            node_config.update(config.get("head_node", {}))
        provider.create_node(node_config, {TAG_RAY_NODE_KIND: kind, TAG_RAY_NODE_NAME: f"ray-{kind}",
                                           TAG_RAY_USER_NODE_TYPE: type_name}, 1)
    ec2 = boto3.client("ec2")
    instances = {t["Value"]: i for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]
                 for t in i.get("Tags", []) if t["Key"] == TAG_RAY_NODE_KIND}
    assert set(instances) == {"head", "worker"}
    profiles = {}
    for kind, instance in instances.items():
        assert instance["MetadataOptions"]["HttpTokens"] == "required", (kind, instance["MetadataOptions"])
        assert [g["GroupId"] for g in instance["SecurityGroups"]] == [sg]
        profiles[kind] = instance["IamInstanceProfile"]["Arn"]
    assert profiles["head"] != profiles["worker"]

    iam = boto3.client("iam")
    roles = {kind: iam.get_instance_profile(InstanceProfileName=arn.rsplit("/", 1)[1])["InstanceProfile"]["Roles"]
             for kind, arn in profiles.items()}
    head_actions = _actions(roles["head"][0]["RoleName"])
    worker_actions = _actions(roles["worker"][0]["RoleName"])
    assert "ec2:RunInstances" in head_actions and "iam:PassRole" in head_actions  # the autoscaler's needs
    assert worker_actions and not [a for a in worker_actions if not a.startswith("s3:")], worker_actions


def test_control_a_group_ray_creates_opens_ssh_to_the_world(aws):
    """Why cluster.yaml names its group: the shape of the file's former provider.security_group."""
    from ray.autoscaler._private.aws.config import bootstrap_aws
    from ray.autoscaler._private.util import prepare_config

    shipped = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    _, subnet = _users_network(shipped["provider"]["region"], shipped["provider"]["availability_zone"])
    config = _filled(aws, "unused", subnet)
    config["provider"]["security_group"] = {"GroupName": "raylaunch-control", "IpPermissions": [
        {"FromPort": 22, "ToPort": 22, "IpProtocol": "TCP", "IpRanges": [{"CidrIp": CIDR}]}]}
    for node_type in config["available_node_types"].values():
        node_type["node_config"].pop("SecurityGroupIds")
    config = bootstrap_aws(prepare_config(config))
    (sg,) = {tuple(t["node_config"]["SecurityGroupIds"]) for t in config["available_node_types"].values()}
    assert _opens_to_world(_ingress(sg[0]))
