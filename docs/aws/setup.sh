#!/usr/bin/env bash
# Once per AWS account and VPC, before `ray up cluster.yaml`: the security group and the two
# instance profiles that cluster.yaml names. Needs the AWS CLI with rights to create them.
#
#   bash docs/aws/setup.sh VPC_ID YOUR_CIDR BUCKET
#   e.g. bash docs/aws/setup.sh vpc-0abc 203.0.113.0/24 my-raylaunch-runs
#
# It prints the security group's id for cluster.yaml's SecurityGroupIds. Ray's own bootstrap would
# create a group that opens SSH to 0.0.0.0/0 (it adds that rule to any group it creates); a group
# made here opens SSH to YOUR_CIDR only, lets the nodes reach each other, and nothing else.
set -euo pipefail
vpc=${1:?VPC_ID}; cidr=${2:?YOUR_CIDR, e.g. 203.0.113.0/24}; bucket=${3:?BUCKET for run storage}
here=$(cd "$(dirname "$0")" && pwd)
if [ "$cidr" = 0.0.0.0/0 ]; then echo "refusing to open SSH to the world: give your office or VPN range" >&2; exit 2; fi
account=$(aws sts get-caller-identity --query Account --output text)

sg=$(aws ec2 create-security-group --group-name raylaunch-sg --vpc-id "$vpc" \
      --description "raylaunch: nodes reach each other; SSH from $cidr" --query GroupId --output text)
aws ec2 authorize-security-group-ingress --group-id "$sg" \
  --ip-permissions "IpProtocol=-1,UserIdGroupPairs=[{GroupId=$sg}]" >/dev/null
aws ec2 authorize-security-group-ingress --group-id "$sg" --protocol tcp --port 22 --cidr "$cidr" >/dev/null

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for who in head worker; do
  sed -e "s/123456789012/$account/g" -e "s/my-raylaunch-runs/$bucket/g" "$here/$who-policy.json" > "$tmp/$who.json"
  aws iam create-role --role-name "raylaunch-$who" \
    --assume-role-policy-document "file://$here/trust-policy.json" >/dev/null
  aws iam put-role-policy --role-name "raylaunch-$who" --policy-name "raylaunch-$who" \
    --policy-document "file://$tmp/$who.json"
  aws iam create-instance-profile --instance-profile-name "raylaunch-$who" >/dev/null
  aws iam add-role-to-instance-profile --instance-profile-name "raylaunch-$who" --role-name "raylaunch-$who"
done
echo "SecurityGroupIds: [$sg]"
echo "head IamInstanceProfile:   arn:aws:iam::$account:instance-profile/raylaunch-head"
echo "worker IamInstanceProfile: arn:aws:iam::$account:instance-profile/raylaunch-worker"
